"""Train config: dotted overrides, helpful errors with close matches, --help, resume config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from agentrl.cli_args import field_type
from agentrl.rundir import RunDirError
from agentrl.train.cli import load_run_config, main
from agentrl.train.config import ConfigError, TrainConfig, all_keys, build_config, help_text


def test_overrides_are_typed_and_nested():
    cfg = build_config(["env=retool", "actor.lr=1e-5", "rollout.n=8", "actor.freeze=[attention,router]",
                        "algorithm.rollout_correction.rollout_is=token", "env_kwargs.exec_timeout_s=3"])
    assert cfg.actor.lr == 1e-5 and cfg.rollout.n == 8
    assert list(cfg.actor.freeze) == ["attention", "router"]
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.env_kwargs.exec_timeout_s == 3


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["env=retool", "actor.lrr=1"], "Did you mean: actor.lr"),
        (["env=retool", "rolout.n=2"], "Did you mean: rollout.n"),
        (["env=retool", "algorithm.adv_estimator=grop"], "Did you mean: grpo"),
        (["env=retool", "actor.freeze=[atention]"], "Did you mean: attention"),
        (["env=retool", "actor.lr=fast"], "actor.lr"),
        (["env=retool", "rollout.n=1"], "needs rollout.n >= 2"),
        (["env=retool", "rollout.batch_size=3", "actor.num_mini_batches=5"], "divisible"),
        (["env=retool", "device=tpu"], "Valid: cpu, cuda"),
        (["env=retool", "rollout.engine=vllm"], "Valid: auto, decode, transformers"),
        (["env=retool", "rollout.deterministic=true"], "set rollout.engine=decode"),  # auto on the CPU
        (["env=retool", "device=cuda", "rollout.engine=transformers", "rollout.deterministic=true"],
         "needs the decode engine"),
        (["actor.lr=1e-5"], "env is required"),
        (["env=retool", "justaword"], "expected key=value"),
    ],
)
def test_bad_config_errors_suggest_fixes(argv, expected):
    with pytest.raises(ConfigError, match=None) as info:
        build_config(argv)
    assert expected in str(info.value)


def test_deterministic_rollouts_with_the_decode_engine_are_valid():
    cfg = build_config(["env=retool", "rollout.engine=decode", "rollout.deterministic=true"])
    assert cfg.rollout.engine == "decode" and cfg.rollout.deterministic
    assert build_config(["env=retool", "device=cuda", "rollout.deterministic=true"]).rollout.engine == "auto"


def test_help_lists_every_key(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in all_keys():
        assert f"  {key} = " in out
    assert "algorithm.adv_estimator = grpo  [" in help_text()


def test_cli_bad_key_exits_2(capsys):
    assert main(["env=retool", "trainer.totl_steps=3"]) == 2
    assert "trainer.total_steps" in capsys.readouterr().err


def test_resume_uses_saved_config_plus_overrides(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(build_config(["env=gsm8k", "actor.lr=3e-6", "trainer.total_steps=4"]), run / "config.yaml")
    cfg = load_run_config([f"resume={run}", "trainer.total_steps=6"])
    assert cfg.env == "gsm8k" and cfg.actor.lr == 3e-6 and cfg.trainer.total_steps == 6
    assert cfg.run_dir == str(run) and cfg.resume == str(run)
    # --resume DIR is resume=DIR (the README's `--key value` works everywhere)
    dashed = load_run_config(["--resume", str(run), "--trainer.total_steps", "6"])
    assert OmegaConf.to_container(dashed) == OmegaConf.to_container(cfg)
    with pytest.raises(RunDirError, match="config.yaml is missing"):
        load_run_config([f"resume={tmp_path / 'missing'}"])


@pytest.mark.parametrize(("content", "expected"), [("", "is empty"), ("env: [unclosed\n", "not a readable config")])
def test_damaged_saved_config_is_one_line_and_exit_2(tmp_path, capsys, content, expected):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(content)
    assert main([f"--resume={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "config.yaml" in err and "\n" not in err
    assert (run / "config.yaml").read_text() == content  # nothing overwritten


def test_a_written_config_cut_at_any_line_is_refused(tmp_path):
    """A ``config.yaml`` agentrl wrote and something cut short is refused wherever the cut lands, even where the
    rest is valid YAML that fits the schema (the missing keys would silently take their defaults)."""
    from agentrl import rundir

    text = rundir.config_yaml_text(build_config(["env=retool", "actor.lr=3e-6"]))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(text)
    assert load_run_config([f"resume={run}"]).actor.lr == 3e-6  # whole: read as written
    lines = text.splitlines(keepends=True)
    for cut in range(1, len(lines)):
        (run / "config.yaml").write_text("".join(lines[:cut]))
        with pytest.raises(RunDirError, match="cut short"):
            rundir.read_config_yaml(run, fix="restore it")


def test_cli_unknown_env_and_model_suggest(tmp_path, capsys):
    assert main(["env=retol", f"run_dir={tmp_path / 'a'}", "trainer.tensorboard=false"]) == 2
    assert "Did you mean: retool?" in capsys.readouterr().err
    assert main(["env=retool", "model=smollm2-135", f"run_dir={tmp_path / 'b'}", "trainer.tensorboard=false"]) == 2
    assert "Did you mean: smollm2-135m" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # a failed start writes nothing


def test_run_dir_holding_a_run_needs_resume_or_overwrite(tmp_path, capsys):
    from agentrl.train.cli import check_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("env: gsm8k\n")
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="resume=.*overwrite=true"):
        check_run_dir(build_config(["env=gsm8k", f"run_dir={run}"]))
    check_run_dir(build_config(["env=gsm8k", f"run_dir={run}", "overwrite=true"]))
    assert not run.exists()  # removed: the run starts afresh
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not a run directory"):
        check_run_dir(build_config(["env=gsm8k", f"run_dir={other}", "overwrite=true"]))
    assert (other / "mine.txt").exists()


# ---------------------------------------------------------------------------- defaults per device
def test_gpu_and_verl_runs_do_not_inherit_the_cpu_defaults():
    from agentrl.train.config import DEVICE_KEYS, TrainConfig, profile_values

    schema = OmegaConf.structured(TrainConfig)
    cpu = build_config(["env=retool"])
    for key in DEVICE_KEYS:  # the CPU run is the dataclass defaults
        assert OmegaConf.select(cpu, key) == OmegaConf.select(schema, key), key
    for argv, profile in ((["device=cuda"], "cuda"), (["backend=verl", "model=Qwen/Qwen3-8B"], "verl")):
        cfg = build_config(["env=retool", *argv])
        for key, value in profile_values("gpu").items():  # one profile for both: declared once per key
            assert OmegaConf.select(cfg, key) == value, key
            if key != "rollout.temperature":  # the CPU run samples at 1.0 as well (GRPO needs varied groups)
                assert value != OmegaConf.select(schema, key), f"{profile} should not share the CPU value of {key}"
    assert {"actor.lr", "trainer.total_steps", "rollout.temperature"} <= set(DEVICE_KEYS)


def test_every_default_is_bounded_by_steps_not_wall_time():
    # a slower machine takes longer and gets the same numbers; a time budget is asked for explicitly
    for overrides in ([], ["device=cuda"], ["backend=verl"]):
        assert build_config(["env=retool", *overrides]).trainer.max_wall_s == 0
    from agentrl.train.config import DEVICE_KEYS

    assert "trainer.max_wall_s" not in DEVICE_KEYS
    assert build_config(["env=retool", "trainer.max_wall_s=1080"]).trainer.max_wall_s == 1080


def test_device_defaults_never_override_the_command_line():
    cfg = build_config(["env=retool", "device=cuda", "actor.lr=3e-6", "trainer.max_wall_s=600"])
    assert cfg.actor.lr == 3e-6 and cfg.trainer.max_wall_s == 600
    assert cfg.trainer.total_steps == 200  # the others still come from the cuda profile
    # a parent key counts as setting its children
    cfg = build_config(["env=retool", "device=cuda", "trainer={total_steps: 7}"])
    assert cfg.trainer.total_steps == 7


def test_resume_keeps_the_saved_values(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(build_config(["env=retool", f"run_dir={run}"]), run / "config.yaml")
    cpu = build_config(["env=retool"])
    cfg = load_run_config([f"resume={run}", "device=cuda"])
    assert cfg.device == "cuda" and cfg.actor.lr == cpu.actor.lr != 1e-6  # as saved, not the cuda profile's
    assert cfg.rollout.temperature == cpu.rollout.temperature


def test_the_start_line_names_the_profile_and_what_was_set():
    from agentrl.train.config import describe_device_defaults

    line = describe_device_defaults(build_config(["env=retool", "device=cuda", "actor.lr=3e-6"]))
    assert line.startswith("device=cuda defaults: ")
    assert "actor.lr=3e-06 (set)" in line and "rollout.temperature=1.0 " in line
    assert "trainer.total_steps=200 " in line
    cpu = build_config(["env=retool"])
    assert describe_device_defaults(cpu).startswith(f"device=cpu defaults: actor.lr={cpu.actor.lr!r} ")
    assert "(set)" not in describe_device_defaults(cpu)
    assert "(device=cuda) or a verl run (backend=verl): " in help_text() and "actor.lr=1e-06" in help_text()


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", [k for k in all_keys() if field_type(TrainConfig, k) is float])
def test_every_float_key_refuses_inf_and_nan(name, value):
    """A property of the declarations, not a list of keys: no number of any key may be inf or NaN (they would
    skip every step or corrupt the weights)."""
    with pytest.raises(ConfigError, match=f"{name} must be a finite number"):
        build_config(["env=retool", f"{name}={value}"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["actor.betas=[0.9,nan]"], "actor.betas must be a finite number"),
        (["algorithm.rollout_correction.rollout_is_threshold=-1"], "rollout_is_threshold=-1: rollout_is_threshold"),
        (["algorithm.rollout_correction.rollout_is_threshold=nan"], "must be a finite number > 0"),
        (["algorithm.rollout_correction.rollout_is_threshold=inf"], "must be a finite number > 0"),
        (["algorithm.rollout_correction.rollout_is_threshold='0.5_nan'"], "'lo_hi' with 0 < lo <= hi"),
        (["algorithm.rollout_correction.rollout_is_threshold='2_0.5'"], "'lo_hi' with 0 < lo <= hi"),
        (["algorithm.rollout_correction.rollout_rs=token_k9"], "unknown rollout_rs option 'token_k9'"),
        (["algorithm.rollout_correction.rollout_rs=token_k3"], "rollout_rs_threshold is required"),
        (["algorithm.rollout_correction.rollout_rs=token_k3", "algorithm.rollout_correction.rollout_rs_threshold=nan"],
         "bad rollout_rs_threshold 'nan'"),
    ],
)
def test_rollout_correction_values_are_checked_at_config_time(argv, expected):
    with pytest.raises(ConfigError) as info:
        build_config(["env=retool", *argv])
    assert expected in str(info.value) and "\n" not in str(info.value)
    # the valid forms still pass
    build_config(["env=retool", "algorithm.rollout_correction.rollout_is_threshold='0.5_2.0'",
                  "algorithm.rollout_correction.rollout_rs=seq_mean_k1,token_k3",
                  "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,3.0'"])
