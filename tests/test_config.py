import json

import pytest

from zerotrain.cli import main
from zerotrain.config import ConfigError, build_config, load_config, parse_overrides


def test_defaults_validate():
    cfg = build_config({})
    assert cfg.optimizer.name == "adamw" and cfg.zero.stage == 0


def test_overrides_nest_and_coerce():
    d = parse_overrides(["--optimizer.lr", "3e-4", "--zero.stage=2", "--optimizer.betas",
                         "[0.8, 0.9]"])
    assert d == {"optimizer": {"lr": "3e-4", "betas": [0.8, 0.9]}, "zero": {"stage": 2}}
    cfg = build_config(d)
    assert cfg.optimizer.lr == pytest.approx(3e-4) and cfg.zero.stage == 2


def test_unknown_key_suggests():
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer\.lrr'.*'optimizer\.lr'"):
        build_config({"optimizer": {"lrr": 1}})
    with pytest.raises(ConfigError, match=r"did you mean 'optimizer'"):
        build_config({"optimiser": {}})


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"config field 'optimizer.lr'.*got 'fast'"):
        build_config({"optimizer": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=r"'zero.stage'"):
        build_config({"zero": {"stage": 5}})


def test_impossible_combinations():
    with pytest.raises(ConfigError, match=r"offload_optimizer needs zero\.stage 2 or 3"):
        build_config({"zero": {"stage": 1, "offload_optimizer": "cpu"}})
    with pytest.raises(ConfigError, match=r"divisible by model\.n_head"):
        build_config({"model": {"n_embd": 10, "n_head": 3}})
    for stage in (1, 2, 3):  # distributed Muon: every stage accepts it
        build_config({"optimizer": {"name": "muon"}, "zero": {"stage": stage}})
    with pytest.raises(ConfigError, match="warmup"):
        build_config({"train": {"steps": 10}, "schedule": {"warmup_steps": 20}})


def test_file_loading_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optimizer:\n  lr: 0.01\n")
    assert load_config(f, ["--optimizer.lr", "0.02"]).optimizer.lr == 0.02
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"zero": {"stage": 3}}))
    assert load_config(j).zero.stage == 3
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer: [1, 2\n")
    with pytest.raises(ConfigError, match="could not be parsed"):
        load_config(bad)


def test_cli_config_show(capsys):
    assert main(["config", "show", "--zero.stage", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["zero"]["stage"] == 3 and out["precision"]["loss_scale"]["window"] == 1000


def test_cli_user_errors_are_one_line(capsys, tmp_path):
    assert main(["train", "--optimizer.lrr", "1"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'optimizer.lr'" in err and "Traceback" not in err
    # its own run folder: the checkout's runs/default may hold `make train`'s run
    assert main(["train", "--data.path", "/nonexistent/corpus", "--train.steps", "1",
                 "--schedule.warmup_steps", "0", "--logging.run_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "data.path '/nonexistent/corpus' does not exist" in err
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err
