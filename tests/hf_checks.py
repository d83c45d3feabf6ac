"""Checks shared by the Hugging Face family tests, on a tiny model written by transformers itself: it
imports, generates greedily as transformers does, exports back to the same tensors, and the imported
checkpoint trains its first step with transformers' own loss."""

import torch
import torch.nn.functional as F
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file

from megand.core.checkpointing import offline
from megand.tools import convert_checkpoint, generate
from tests.harness import read_metrics, run_pretrain


def save_and_import(build, root, scale: float = 0.1, move=None, edit_files=None):
    """(transformers model, its directory, the imported megand checkpoint): ``build()``'s model made at seed 0,
    its 1-D tensors (norm weights, biases) moved ``scale`` away from their init so that a misplaced or unread
    one shows, ``move(model)`` for others, written by transformers' ``save_pretrained`` (then
    ``edit_files(hf_dir)``) and imported by ``convert_checkpoint``."""
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * scale)
        if move is not None:
            move(model)
    model.save_pretrained(hf_dir)
    if edit_files is not None:
        edit_files(root / "hf")
    assert convert_checkpoint.main(["import", "--hf", hf_dir, "--save", ckpt]) == 0
    return model, hf_dir, ckpt


def imports_by_family(tmp_path_factory, build_of):
    """``get(family)`` -> :func:`save_and_import` of ``build_of(family)()``, made once per family."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = save_and_import(build_of(family), tmp_path_factory.mktemp(family))
        return cache[family]

    return get


def move_correction_biases(model):
    """A sigmoid router's correction biases (every MoE layer after the first, dense one) away from zero."""
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)


def first_step_loss_equals_transformers(name: str, theirs, ckpt: str, nproc: int, overrides, tmp_path):
    """Train one step from ``ckpt`` with no model key (the checkpoint's model) on ``nproc`` ranks; its loss
    equals ``theirs`` (the transformers model) on the same batch within 1e-5 relative. Returns the batch's
    tokens ``[b, s + 1]`` and the step's metrics record."""
    run_dir = str(tmp_path / "run")
    proc = run_pretrain(run_dir, [f"checkpoint.load={ckpt}", "train.iters=1", "train.eval_iters=0", *overrides],
                        nproc=nproc)
    assert "model from checkpoint" in proc.stdout
    record = read_metrics(run_dir)[0]
    loss = record["loss"]

    from megand.training.core_configs import dataset_plan
    from megand.training.pretrain import build_datasets

    cfg = OmegaConf.load(f"{run_dir}/config.yaml")
    train, _ = build_datasets(dataset_plan(cfg), offline.single_process_topology())
    tokens = torch.stack([torch.as_tensor(train[i], dtype=torch.long) for i in range(cfg.train.global_batch_size)])
    with torch.no_grad():
        logits = theirs(input_ids=tokens[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    print(f"{name}: first-step loss {loss:.8f}, transformers {expected:.8f}")
    assert abs(loss - expected) / expected <= 1e-5, (loss, expected)
    return tokens, record


def assert_generation_and_export_equal(theirs, hf_dir, ckpt, out, capsys, prompt=None):
    """Greedy generation of 20 tokens from an 8-token prompt equals transformers'; the fp32 export to ``out``
    holds exactly the tensors of the files transformers wrote. -> the exported config."""
    if prompt is None:
        prompt = torch.randint(0, 251, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                   pad_token_id=0)[0].tolist()
    capsys.readouterr()
    assert generate.main(["--load", ckpt, "--ids", *map(str, prompt), "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected]

    assert convert_checkpoint.main(["export", "--load", ckpt, "--out", out, "--dtype", "fp32"]) == 0
    # the tensors of the files transformers wrote (a MoE model's experts are fused in its state dict, one
    # tensor per expert and projection in its files)
    exported, original = load_file(f"{out}/model.safetensors"), load_file(f"{hf_dir}/model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    return transformers.AutoConfig.from_pretrained(out)
