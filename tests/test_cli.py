"""The `phyai-ray` command line: plan output, generated flags, config building, errors.

Run: .venv/bin/pytest tests/test_cli.py -q
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from phyai_ray import __version__
from phyai_ray.cli import build_parser, main
from phyai_ray.flags import GENERATED, RENAMED, build_configs, config_flags
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.registry import register_plugin
from tests.helpers import console_script


def flat(text: str) -> str:
    return " ".join(text.split())


def group_line(out: str, name: str) -> str:
    return next(line.strip() for line in out.splitlines() if line.strip().startswith(f"{name}:"))


def test_console_script_plans_8_ranks_tp2_pp4() -> None:
    done = subprocess.run([console_script("phyai-ray"), "plan", "--pp-size", "4", "--dense-tp-size", "2", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert group_line(done.stdout, "dense_tp") == "dense_tp: [0,1] [2,3] [4,5] [6,7]"
    assert group_line(done.stdout, "pp") == "pp: [0,2,4,6] [1,3,5,7]"
    assert "ranks per replica: 8" in done.stdout and "workers: 8" in done.stdout


def test_plan_imports_neither_ray_nor_torch_on_cpu() -> None:
    code = ("import sys; from phyai_ray.cli import main; rc = main(['plan', '--pp-size', '2', '--device', 'cpu']); "
            "print('LOADED', [m for m in ('ray', 'torch') if m in sys.modules], rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED [] 0" in done.stdout, done.stdout + done.stderr


def test_plan_reports_counts_mode_bundles_and_every_group(capsys) -> None:
    assert main(["plan", "--pp-size", "2", "--cfg-size", "2", "--dense-tp-size", "2", "--replicas", "2",
                 "--device", "cpu", "--cpus-per-rank", "2"]) == 0
    out = capsys.readouterr().out
    for line in ["ranks per replica: 8", "replicas: 2", "workers: 16", "mode: auto -> local",
                 "replica 0: 8 rank(s), STRICT_PACK, bundle={'CPU': 2.0}", "replica 1: 8 rank(s)",
                 "output rank: 4", "cfg: [0,2] [1,3] [4,6] [5,7]", "pp: [0,4] [1,5] [2,6] [3,7]",
                 "moe_dp: [0,1] [2,3] [4,5] [6,7]", "world: [0,1,2,3,4,5,6,7]"]:
        assert line in out, (line, out)


def test_plan_of_one_rank_is_inline_without_bundles(capsys) -> None:
    assert main(["plan", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "mode: auto -> inline" in out and "bundles: none (inline mode" in out and "workers: 1" in out


def test_plan_gpu_bundles_and_devices(capsys) -> None:
    assert main(["plan", "--device", "cuda", "--replicas", "2", "--dense-tp-size", "2", "--devices", "3,2,1,0"]) == 0
    out = capsys.readouterr().out
    assert "replica 1: 2 rank(s), STRICT_PACK, bundle={'CPU': 1.0, 'GPU': 1.0} devices=[1, 0]" in out


@register_plugin
class CliDenseOnlyEntry(Entry):
    """A fake plugin that splits dense layers only, to check `plan --plugin`."""

    name = "cli_test_dense_only"
    parallel_domains = frozenset({"dense"})


def test_plan_checks_the_plugin_when_given(capsys) -> None:
    assert main(["plan", "--device", "cpu", "--plugin", "cli_test_dense_only", "--dense-tp-size", "2"]) == 0
    assert "plugin: cli_test_dense_only accepts this topology" in capsys.readouterr().out
    assert main(["plan", "--device", "cpu", "--plugin", "cli_test_dense_only", "--pp-size", "2"]) == 2
    assert "splits pp=2" in capsys.readouterr().err


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"phyai-ray {__version__}"


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_help_lists_every_generated_flag_with_its_description(command, capsys) -> None:
    assert main([command, "--help"]) == 0
    text = flat(capsys.readouterr().out)
    models = {section: model for section, model, _ in GENERATED}
    models.update({section: model for _, section, model, _ in RENAMED})
    flags = config_flags()
    assert {"--pp-size", "--dense-tp-size", "--attention-cp-size", "--moe-ep-size", "--execution-timeout-s",
            "--replicas", "--device", "--dtype"} <= set(flags)
    for flag, (section, name) in flags.items():
        field = models[section].model_fields[name]
        assert flag in text
        assert f"{flat(field.description)} (default: {field.default})" in text, flag


def parse(*argv: str):
    return build_parser().parse_args(["serve", "tiny_tp", *argv])


def test_build_configs_keeps_unset_domains_unset() -> None:
    engine, deployment = build_configs(parse("--dense-tp-size", "2", "--replicas", "3", "--execution-timeout-s",
                                             "5", "--plugin-args", '{"hidden": 64}', "--dtype", "bfloat16"))
    parallel = engine.config.parallel
    assert engine.plugin == "tiny_tp" and engine.plugin_args == {"hidden": 64}
    assert parallel.explicit_domains == {"dense"} and parallel.dense.tp_size == 2
    assert parallel.attention.dp_size == 2 and parallel.moe.dp_size == 2  # inferred
    assert engine.config.device.params_dtype == "bfloat16" and engine.config.device.target == "auto"
    assert deployment.replica_count == 3 and deployment.mode == "auto"
    assert deployment.process_config.execution_timeout_s == 5.0
    assert deployment.process_config.startup_timeout_s == 300.0
    assert deployment.process_config.model_fields_set == {"execution_timeout_s"}


def test_build_configs_defaults_match_the_models() -> None:
    engine, deployment = build_configs(parse())
    assert engine.config.parallel.explicit_domains == frozenset()
    assert engine.config.parallel.infer_replica_world_size() == 1 and engine.plugin_args == {}
    assert deployment.model_dump() == type(deployment)().model_dump()


@pytest.fixture
def run_server_calls(monkeypatch) -> list:
    """Replaces `run_server` (nothing starts); each call's (engine, deployment, keywords)."""
    calls: list = []
    fake_server = types.ModuleType("phyai_ray.serve.runtime.server")
    fake_server.run_server = lambda engine, deployment, **kw: calls.append((engine, deployment, kw))
    monkeypatch.setitem(sys.modules, "phyai_ray.serve.runtime.server", fake_server)
    monkeypatch.delenv("PHYAI_RAY_API_KEY", raising=False)
    monkeypatch.delenv("PHYAI_RAY_API_KEYS", raising=False)
    return calls


def test_serve_passes_configs_and_http_settings_to_run_server(run_server_calls, monkeypatch) -> None:
    monkeypatch.setenv("PHYAI_RAY_API_KEY", "from-env")
    assert main(["serve", "tiny_tp", "--attention-cp-size", "2", "--port", "9001", "--max-body-bytes", "1000",
                 "--overload-status", "429"]) == 0
    engine, deployment, kw = run_server_calls[0]
    assert engine.config.parallel.explicit_domains == {"attention"}
    assert kw == {"host": "127.0.0.1", "port": 9001, "api_key": "from-env", "max_body_bytes": 1000,
                  "overload_status": 429}


def test_serve_autoscaling_flags_reach_run_server(run_server_calls) -> None:
    assert main(["serve", "tiny_tp", "--min-replicas", "1", "--max-replicas", "3",
                 "--target-ongoing-requests", "1.5"]) == 0
    kw = run_server_calls[0][2]
    assert (kw["min_replicas"], kw["max_replicas"], kw["target_ongoing_requests"]) == (1, 3, 1.5)
    assert main(["serve", "tiny_tp", "--replicas", "2"]) == 0
    assert "min_replicas" not in run_server_calls[1][2] and run_server_calls[1][1].replica_count == 2


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_serve_on_loopback_needs_no_key(run_server_calls, host: str) -> None:
    assert main(["serve", "tiny_tp", "--host", host]) == 0
    assert run_server_calls[0][2]["api_key"] is None and run_server_calls[0][2]["overload_status"] == 503


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])
def test_serve_refuses_a_reachable_host_without_a_key_unless_insecure(run_server_calls, host: str, capsys) -> None:
    assert main(["serve", "tiny_tp", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"phyai-ray serve: error: --host {host} accepts connections from other machines") and \
        "--api-key" in err and "--insecure" in err, err
    assert run_server_calls == []
    assert main(["serve", "tiny_tp", "--host", host, "--insecure"]) == 0
    assert main(["serve", "tiny_tp", "--host", host, "--api-key", "k"]) == 0
    assert [kw["host"] for _, _, kw in run_server_calls] == [host, host]


def test_tenant_keys_from_a_file_or_the_environment_reach_run_server(run_server_calls, monkeypatch, tmp_path,
                                                                   capsys) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('{"lab-a": "k-a", "lab-b": "k-b"}')
    assert main(["serve", "tiny_tp", "--host", "0.0.0.0", "--api-keys-file", str(keys)]) == 0  # keys: not exposed
    assert run_server_calls[0][2]["api_keys"] == {"lab-a": "k-a", "lab-b": "k-b"}
    monkeypatch.setenv("PHYAI_RAY_API_KEYS", '{"lab-c": "k-c"}')
    assert main(["serve", "tiny_tp"]) == 0 and run_server_calls[1][2]["api_keys"] == {"lab-c": "k-c"}
    keys.write_text('["k-a"]')
    assert main(["serve", "tiny_tp", "--api-keys-file", str(keys)]) == 2
    assert "must hold a JSON object of tenant names to keys" in capsys.readouterr().err
    monkeypatch.setenv("PHYAI_RAY_API_KEYS", "k-a")
    assert main(["serve", "tiny_tp"]) == 2 and "$PHYAI_RAY_API_KEYS not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["plan", "--dense-tp-size", "0"], "--dense-tp-size=0: Input should be greater than or equal to 1"),
    (["plan", "--cfg-size", "3"], "--cfg-size=3: Input should be less than or equal to 2"),
    (["plan", "--execution-timeout-s", "0"], "--execution-timeout-s=0.0: Input should be greater than 0"),
    (["plan", "--dense-tp-size", "2", "--attention-tp-size", "4"], "dense=2*1=2 (tp*dp), attention=4*1*1=4"),
    (["plan", "--mode", "inline", "--pp-size", "2"], "needs 2 ranks per replica"),
    (["plan", "--replicas", "2", "--devices", "0,1,2"], "lists 3 devices but 2 replica(s)"),
    (["plan", "--plugin", "no_such_plugin"], "no plugin named 'no_such_plugin'"),
    (["serve", "p", "--mode", "external", "--replicas", "2"], "runs exactly one replica, got replica_count=2"),
    (["serve", "p", "--mode", "inline", "--dense-tp-size", "2"], "needs 2 ranks per replica"),
])
def test_config_errors_exit_2_with_one_line(argv, fragment, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"phyai-ray {argv[0]}: error: "), err
    assert fragment in err, err


@pytest.mark.parametrize("argv, fragment", [
    (["plan", "--pp-size", "two"], "invalid int value: 'two'"),
    (["plan", "--devices", "a,b"], "comma-separated list of ints"),
    (["plan", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["serve", "p", "--plugin-args", "{bad"], "not valid JSON"),
    (["serve", "p", "--plugin-args", "[1]"], "must be a JSON object, got list"),
    (["serve", "p", "--port", "70000"], "70000 is outside [1, 65535]"),
    (["serve", "p", "--overload-status", "500"], "invalid choice: 500 (choose from 503, 429)"),
    (["serve"], "required: plugin"),
    ([], "required: {plan,serve}"),
])
def test_usage_errors_exit_2(argv, fragment, capsys) -> None:
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_protocol_flags_reach_run_server(run_server_calls) -> None:
    assert main(["serve", "tiny_tp", "--grpc-port", "9000", "--no-openpi"]) == 0
    assert main(["serve", "tiny_tp", "--no-oip-http"]) == 0
    assert run_server_calls[0][2]["grpc_port"] == 9000 and run_server_calls[0][2]["openpi"] is False
    assert "oip_http" not in run_server_calls[0][2]  # on unless switched off
    assert run_server_calls[1][2]["oip_http"] is False and "grpc_port" not in run_server_calls[1][2]
    assert main(["serve", "tiny_tp", "--grpc-port", "0"]) == 2  # outside [1, 65535]: a usage error
