"""`python -m executor.serve` arguments: policy defaults come from PolicyConfig, a
--policy file overrides them and flags override the file; bad values exit 2 naming them."""

from __future__ import annotations

import pytest

from executor.serve import ServeConfig, config_from_args, main, parse_args
from policy.config import GIB, PolicyConfig


def test_defaults_are_the_config_classes():
    cfg = config_from_args(parse_args([]))
    assert cfg == ServeConfig() and cfg.policy == PolicyConfig()


def test_flags_override_the_policy_file(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("lanes = 3\nwarm_quiet_ms = 10\nrequest_starts = true\n")
    cfg = config_from_args(parse_args(["--policy", str(path), "--lanes", "5", "--no-request-starts",
                                       "--prompt-cache-gib", "0.5", "--context", "128", "--port", "0"]))
    p = cfg.policy
    assert (p.lanes, p.warm_quiet_ms, p.request_starts, p.prompt_cache_bytes) == (5, 10.0, False, GIB // 2)
    assert (cfg.context_rows, cfg.port) == (128, 0)
    assert config_from_args(parse_args(["--prompt-cache-gib", "0"])).policy.warm_active is False


@pytest.mark.parametrize("argv, word", [(["--lanes", "0"], "lanes"), (["--prompt-cache-gib", "-1"], "prompt-cache-gib"),
                                        (["--context", "0"], "context_rows"), (["--warm-quiet-ms", "-5"], "warm_quiet_ms")])
def test_bad_values_exit_2_naming_them(argv, word, capsys):
    assert main(argv) == 2
    assert word in capsys.readouterr().err
