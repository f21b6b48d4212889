"""The wrapper's patches on vLLM 0.32: applied once whatever is imported first, named when
missing, removable in-process (the checks are `wrapper_patches`', shared with vLLM 0.9.2)."""

from __future__ import annotations

import pytest
from wrapper_patches import ORDERS, check_import_order, check_injection_comes_off, check_missing_patch_point_is_named


@pytest.mark.parametrize("order", ORDERS)
def test_every_patch_is_applied_once_whatever_is_imported_first(order):
    check_import_order(order)


def test_the_injection_comes_off_again(monkeypatch):
    check_injection_comes_off(monkeypatch)


def test_a_patch_point_vllm_lacks_is_an_import_error_naming_it(monkeypatch):
    check_missing_patch_point_is_named(monkeypatch)
