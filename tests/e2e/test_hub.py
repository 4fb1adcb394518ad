"""``lowmem-tpu push``: the real huggingface_hub client against a local Hub-compatible server
(tests/helpers/hub_server.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from hub_server import FakeHub
from tiny_models import make_adapter, make_base

from lowmem_tpu.config import load_recipe
from lowmem_tpu.errors import UserError
from lowmem_tpu.publish.hub import check_push_ready, push, push_after_training
from lowmem_tpu.publish.merge import merge_adapter

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_FAKEtoken0123456789abcdefSECRET"  # must never be printed or written


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An adapter directory like output_dir/final (trained on a Hub dataset) and its merged model."""
    root = tmp_path_factory.mktemp("hub")
    base = make_base(root / "base")
    adapter = make_adapter(base, root / "final", overrides=("data.path=tatsu-lab/alpaca", "data.format=alpaca"))
    merged = merge_adapter(adapter, root / "merged", dtype="float32").out
    return adapter, merged


@pytest.fixture(autouse=True)
def token_never_printed(capfd):
    """Whatever a test does, the token appears in no output (failure messages are checked where raised)."""
    yield
    out, err = capfd.readouterr()
    assert TOKEN not in out + err


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    with FakeHub() as server:
        server.add_user(TOKEN, "alice", orgs=["acme"])
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


@contextmanager
def refused(match: str) -> Iterator[pytest.ExceptionInfo[UserError]]:
    """pytest.raises(UserError) that also checks the message does not hold the token."""
    with pytest.raises(UserError, match=match) as err:
        yield err
    assert TOKEN not in str(err.value)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def card(files: dict[str, bytes]) -> tuple[dict, str]:
    _, meta, body = files["README.md"].decode().split("---\n", 2)
    return yaml.safe_load(meta), body


def local_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_push_adapter_creates_the_repo_in_one_commit(run, hub):
    adapter, _ = run
    result = push(adapter, "alice/tiny-lora", create=True, license="apache-2.0", base_model="acme/tiny-base")

    repo = hub.repos["alice/tiny-lora"]
    assert not repo.private and len(repo.branches["main"]) == 2  # the initial commit, then ours
    head = repo.head()
    assert result.commit_url == f"{hub.url}/alice/tiny-lora/commit/{head.oid}"
    assert head.summary == "Upload adapter (lowmem-tpu)"
    expected = local_files(adapter)
    arrived = {k: v for k, v in head.files.items() if k not in ("README.md", ".gitattributes", "adapter_config.json")}
    assert arrived == {k: v for k, v in expected.items() if k != "adapter_config.json"}
    assert {u.path_in_repo for u in result.files} == set(expected) | {"README.md"}
    uploaded = json.loads(head.files["adapter_config.json"])
    assert uploaded["base_model_name_or_path"] == "acme/tiny-base"  # loadable from the Hub
    assert json.loads(expected["adapter_config.json"])["base_model_name_or_path"] == str(adapter.parent / "base")

    meta, body = card(head.files)
    assert meta["base_model"] == "acme/tiny-base"
    assert meta["library_name"] == "peft" and meta["license"] == "apache-2.0"
    assert meta["datasets"] == ["tatsu-lab/alpaca"] and meta["pipeline_tag"] == "text-generation"
    assert {"lowmem-tpu", "lora", "sft"} <= set(meta["tags"])
    for text in ("## Training data", "`tatsu-lab/alpaca`", "## Recipe", "| exact match | 0.0000 | 1.0000 |"):
        assert text in body
    assert "139,264 trainable of 808,064" in body and "not recorded for this run" in body
    assert 'PeftModel.from_pretrained(base, "alice/tiny-lora")' in body
    assert head.files["recipe.yaml"] == (adapter / "recipe.yaml").read_bytes()


def test_push_merged_model_to_a_new_branch_of_an_org_repo(run, hub):
    adapter, merged = run
    hub.create("acme/tiny-merged")
    push(adapter, "acme/tiny-merged")  # the adapter on main, then the merged model on a branch from main
    main_before = hub.repos["acme/tiny-merged"].head().oid
    result = push(merged, "acme/tiny-merged", revision="dev")

    repo = hub.repos["acme/tiny-merged"]
    assert repo.head().oid == main_before  # main untouched
    files = repo.head("dev").files
    assert (
        "adapter_config.json" not in files and "adapter_model.safetensors" not in files
    )  # else it loads as the adapter
    assert {"model.safetensors", "config.json", "merge.json", "recipe.yaml", "tokenizer.json"} <= set(files)
    assert files["model.safetensors"] == (merged / "model.safetensors").read_bytes()
    meta, body = card(files)
    assert meta["library_name"] == "transformers" and "merged-lora" in meta["tags"] and meta["license"] == "other"
    assert "## Merge check" in body and 'from_pretrained("acme/tiny-merged", revision="dev")' in body
    assert result.revision == "dev"


def test_dry_run_lists_files_and_sizes_without_network_or_token(run, monkeypatch):
    from huggingface_hub import constants

    adapter, _ = run
    monkeypatch.setattr(constants, "ENDPOINT", closed_port_url())
    monkeypatch.delenv("HF_TOKEN", raising=False)
    result = push(adapter, "alice/tiny-lora", dry_run=True)
    sizes = {u.path_in_repo: u.size for u in result.files}
    assert result.commit_url is None
    assert sizes.pop("README.md") > 500
    assert sizes == {p.name: p.stat().st_size for p in adapter.iterdir()}


def test_missing_repository_offers_create(run, hub):
    adapter, _ = run
    with refused(r"alice/nope does not exist .*pass --create"):
        push(adapter, "alice/nope")
    assert "alice/nope" not in hub.repos


def test_token_problems(run, hub, monkeypatch):
    adapter, _ = run
    monkeypatch.delenv("HF_TOKEN")
    with refused("no Hugging Face token found: set HF_TOKEN or run `hf auth login`"):
        push(adapter, "alice/x", create=True)
    assert hub.requests == []
    monkeypatch.setenv("HF_TOKEN", "hf_wrongWRONGwrong")
    with refused("token was rejected") as err:
        push(adapter, "alice/x", create=True)
    assert "hf_wrongWRONGwrong" not in str(err.value)


def test_token_from_the_standard_login(run, hub, monkeypatch):
    from huggingface_hub import constants

    adapter, _ = run
    monkeypatch.delenv("HF_TOKEN")
    Path(constants.HF_TOKEN_PATH).parent.mkdir(parents=True)
    Path(constants.HF_TOKEN_PATH).write_text(TOKEN)
    assert push(adapter, "alice/from-login", create=True).commit_url


def test_no_permission(run, hub, monkeypatch):
    adapter, _ = run
    with refused("no permission to push to bob/x: the token belongs to alice"):
        push(adapter, "bob/x", create=True)
    hub.add_user("hf_readonlyTOKEN", "alice", role="read")
    hub.add_user("hf_scopedTOKEN", "carol", role="fineGrained")  # the Hub refuses the write itself
    hub.create("carol/x")
    monkeypatch.setenv("HF_TOKEN", "hf_readonlyTOKEN")
    with refused("token of alice is read-only"):
        push(adapter, "alice/x", create=True)
    monkeypatch.setenv("HF_TOKEN", "hf_scopedTOKEN")
    with refused("no permission to write to carol/x"):
        push(adapter, "carol/x")
    assert len(hub.repos["carol/x"].branches["main"]) == 1


def test_network_unreachable(run, hub, monkeypatch):
    from huggingface_hub import constants

    adapter, _ = run
    url = closed_port_url()
    monkeypatch.setattr(constants, "ENDPOINT", url)
    with refused(f"cannot reach the Hugging Face Hub at {url} \\(ConnectError\\)"):
        push(adapter, "alice/x", create=True)


def test_a_failed_commit_publishes_nothing(run, hub):
    adapter, _ = run
    repo = hub.create("alice/tiny-lora")
    hub.fail_next_commit = True
    with refused("HTTP 500.*nothing was published"):
        push(adapter, "alice/tiny-lora")
    assert len(repo.branches["main"]) == 1
    hub.fail_next_commit = True
    with refused("HTTP 500"):
        push(adapter, "alice/tiny-lora", revision="feature")
    assert set(repo.branches) == {"main"}  # the branch made for the failed commit is gone again


def test_refuses_what_does_not_load_or_a_public_repo_for_private(run, hub, tmp_path):
    adapter, merged = run
    moved = shutil.copytree(adapter, tmp_path / "moved")
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with refused("cannot check that .* loads: its base, .*gone, is not on this machine"):
        push(moved, "alice/broken", create=True)
    broken = shutil.copytree(merged, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with refused("is damaged: model.safetensors has 15 bytes"):  # checked against final's manifest
        push(broken, "alice/broken", create=True)
    (broken / "MANIFEST.json").unlink()  # a model from elsewhere: nothing to check against, so loaded
    with refused("cannot load the model"):
        push(broken, "alice/broken", create=True)
    assert len(hub.repos["alice/broken"].branches["main"]) == 1
    with refused("exists and is public, but --private was asked"):
        push(merged, "alice/broken", private=True)


def test_recipe_push_checks_at_start_and_pushes_at_the_end(run, hub, monkeypatch):
    adapter, _ = run
    check_push_ready(load_recipe(None, []))  # hub.push false: nothing to check
    assert hub.requests == []
    recipe = load_recipe(None, ["hub.push=true", "hub.repo_id=alice/run", "hub.private=true"])
    check_push_ready(recipe)
    assert "alice/run" not in hub.repos  # the check creates nothing
    for bad, message in (("hub.repo_id=alice", "give OWNER/NAME"), ("hub.repo_id=bob/run", "no permission")):
        with refused(message):
            check_push_ready(load_recipe(None, ["hub.push=true", bad]))
    monkeypatch.delenv("HF_TOKEN")
    with refused("no Hugging Face token found"):
        check_push_ready(recipe)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    url = push_after_training(adapter, recipe)
    assert hub.repos["alice/run"].private and url.endswith(hub.repos["alice/run"].head().oid)
    hub.fail_next_commit = True
    with refused("HTTP 500") as err:
        push_after_training(adapter, recipe)
    assert err.value.problems[-1].endswith(
        f"push it later with: lowmem-tpu push {adapter} --repo-id alice/run --create --private"
    )


def test_cli_never_shows_or_writes_the_token(run, hub, tmp_path):
    adapter, _ = run
    home = tmp_path / "hf-home"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": TOKEN, "HF_HOME": str(home)}
    env["PJRT_DEVICE"] = "CPU"

    def cli(*args: str, debug: bool = False) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "lowmem_tpu.cli", "push", str(adapter), *args]
        run_env = env | {"HF_DEBUG": "1"} if debug else env  # HF_DEBUG: huggingface_hub logs every request
        return subprocess.run(command, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=300)

    dry = cli("--repo-id", "alice/cli", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "adapter -> alice/cli (branch main): 8 files" in dry.stdout and "dry run: nothing uploaded" in dry.stdout
    assert f"{(adapter / 'adapter_model.safetensors').stat().st_size:,}  adapter_model.safetensors" in dry.stdout
    assert hub.requests == []
    missing = cli("--repo-id", "alice/cli")
    assert missing.returncode == 2 and "pass --create" in missing.stderr and "Traceback" not in missing.stderr
    done = cli("--repo-id", "alice/cli", "--create", debug=True)
    assert done.returncode == 0, done.stderr
    assert f"pushed: {hub.url}/alice/cli/commit/" in done.stdout

    assert TOKEN in hub.authorizations  # the token did travel, in the Authorization header only
    outputs = [r.stdout + r.stderr for r in (dry, missing, done)]
    assert "authorization" in outputs[-1].lower()  # the debug log shows request headers
    assert not any(TOKEN in text for text in outputs)
    written = [p for root in (home, adapter, tmp_path) for p in root.rglob("*") if p.is_file()]
    assert not any(TOKEN.encode() in p.read_bytes() for p in written)
    assert not any(TOKEN.encode() in data for data in hub.repos["alice/cli"].head().files.values())


def test_card_of_a_full_fine_tuning_run(run, tmp_path):
    from lowmem_tpu.publish.card import model_card

    adapter, merged = run
    final = tmp_path / "final"  # what sft writes with lora.enabled: false
    final.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(merged / name, final / name)
    recipe = yaml.safe_load((adapter / "recipe.yaml").read_text())
    recipe["lora"]["enabled"] = False
    recipe["model"]["name_or_path"] = "openlm-research/open_llama_3b_v2"
    (final / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (final / "metrics.json").write_text(json.dumps({"mode": "full", "num_devices": 8, "platform": "TPU"}))
    meta, body = card({"README.md": model_card(final, "alice/full", "model").encode()})
    assert meta["base_model"] == "openlm-research/open_llama_3b_v2" and meta["library_name"] == "transformers"
    assert "full-fine-tuning" in meta["tags"] and "lora" not in meta["tags"]
    assert "A full fine-tune of [`openlm-research/open_llama_3b_v2`]" in body
    assert "| training | full fine-tuning |" in body and "over 8 TPU devices" in body
