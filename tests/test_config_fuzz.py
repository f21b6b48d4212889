"""Hostile config values: ports in URLs and on the server's command line are ASCII digits in
range, and any text in any `LMCACHE_*` variable is a config or a ValueError naming its key."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.experimental.config import LMCacheEngineConfig, env_var_name, field_names, parse_remote_url
from lmcache.server.__main__ import _parse_args

# Characters `str.isdigit` or `int()` accept that are not a port: superscripts, full-width and
# Arabic-Indic digits, signs, underscores, spaces.
NOT_PORTS = ["²", "５", "٨٠", "+80", "-1", " 80", "8_0", "0", "65536", "", "80a"]


@pytest.mark.parametrize("port", NOT_PORTS)
def test_env_url_with_a_non_ascii_or_out_of_range_port_names_the_key(port: str) -> None:
    with pytest.raises(ValueError, match=r"remote_url=.*port .* is not an integer in 1\.\.65535") as err:
        LMCacheEngineConfig.from_env({"LMCACHE_REMOTE_URL": f"lm://host:{port}"})
    assert "LMCACHE_REMOTE_URL" in str(err.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=8))
def test_any_port_text_parses_exactly_or_names_the_key(text: str) -> None:
    try:
        parsed = parse_remote_url(f"lm://h:{text}")
    except ValueError as err:
        assert "remote_url=" in str(err)
        return
    port = text.strip()  # whitespace around the whole URL is forgiven
    port = port[:-1] if port.endswith("/") else port  # and one trailing slash (`redis://h:1/`)
    assert port.isascii() and port.isdigit() and parsed.hosts == (("h", int(port)),)
    assert 1 <= parsed.hosts[0][1] <= 65535


@pytest.mark.parametrize("port", ["²", "５", "+80", "8_0", "65536", "-1"])
def test_server_cli_port_must_be_ascii_digits_in_range(port: str, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse_args(["127.0.0.1", port])
    assert "PORT" in capsys.readouterr().err
    assert _parse_args(["127.0.0.1", "0"]).port == 0  # 0 = any free port, for tests and embedding


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(field_names()), st.text(max_size=12))
def test_any_text_in_any_variable_is_a_config_or_an_error_naming_the_key(name: str, text: str) -> None:
    try:
        LMCacheEngineConfig.from_env({env_var_name(name): text})
    except ValueError as err:
        assert name in str(err) and env_var_name(name) in str(err)
