"""`dschat export` rebuilds plain HF folders from saved training states (ZeRO shards included)."""

import pytest
import torch

from dschat import engine as E
from dschat.config import EngineArgs, OptimArgs
from dschat.models.loading import create_causal_lm, create_reward_model, load_tokenizer, resolve_model
from dschat.training.checkpoint import save_hf
from dschat.training.export import export_state
from dschat.training.resume import Checkpointer
from tests.helpers import run_cli


def train_and_checkpoint(tmp_path, module, stage, tok):
    eng = E.build_train_engine(module, engine=EngineArgs(zero_stage=stage), optim=OptimArgs(
        learning_rate=1e-2, per_device_train_batch_size=2), dtype=torch.float32, total_steps=2)
    x = torch.randint(10, 200, (2, 8))
    for _ in range(2):
        out = eng(input_ids=x, labels=x).loss if hasattr(eng.module, "lm_head") else eng(x, torch.ones_like(x)).mean()
        eng.backward(out)
        eng.step()
    Checkpointer(tmp_path / "run", {"model": eng}, tokenizer=tok).save(2, {})
    save_hf(eng, tok, tmp_path / "final")  # what the stage itself would save at this point
    return eng


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("kind", ["causal_lm", "reward"])
def test_export_equals_the_stage_save(tmp_path, stage, kind):
    from safetensors.torch import load_file

    E.setup_distributed()
    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    module = create_causal_lm(path) if kind == "causal_lm" else create_reward_model(path,
                                                                                    pad_token_id=tok.pad_token_id)
    train_and_checkpoint(tmp_path, module, stage, tok)
    export_state(tmp_path / "run", tmp_path / "exported")
    want = load_file(str(tmp_path / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert set(want) == set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert (tmp_path / "exported" / "tokenizer.json").exists()


def test_export_cli_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli("export", "--checkpoint", str(tmp_path / "empty"), "--output", str(tmp_path / "o"))
    assert proc.returncode == 2 and "no saved training state" in proc.stderr
