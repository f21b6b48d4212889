"""The wrapper's patches on vLLM 0.32: applied once whatever is imported first, named when
missing, removable in-process (the tests are `wrapper_patches`', shared with vLLM 0.9.2)."""

from __future__ import annotations

from wrapper_patches import (  # noqa: F401  (collected here)
    test_a_patch_point_vllm_lacks_is_an_import_error_naming_it,
    test_every_patch_is_applied_once_whatever_is_imported_first,
    test_the_injection_comes_off_again,
)
