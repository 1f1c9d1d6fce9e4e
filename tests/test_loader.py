"""Loading checkpoints: config reading, sharded weights, fingerprints, and errors that name
the file and the tensor."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.engine.loader import CheckpointError, load_checkpoint
from workers.engine.make_model import make_model


@pytest.fixture()
def qwen3_copy(tiny_qwen3_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Qwen3 checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_qwen3_dir, tmp_path / "model"))


def test_loads_config_tokenizer_and_eos(tiny_qwen3_dir):
    loaded = load_checkpoint(tiny_qwen3_dir)
    c = loaded.config
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "Qwen3ForCausalLM", 64, 2, 4, 2, 16)
    assert c.qk_norm and not c.attention_bias and c.dtype == torch.float32
    tok = loaded.tokenizer
    assert loaded.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>"),
                                    tok.convert_tokens_to_ids("<|endoftext|>")]
    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert loaded.max_model_len == 2048
    assert len(loaded.fingerprint) == 16


def test_llama_rope_scaling_and_qwen2_bias_are_read(tiny_llama_dir, tiny_qwen2_dir):
    llama = load_checkpoint(tiny_llama_dir).config
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_theta == 500_000.0
    qwen2 = load_checkpoint(tiny_qwen2_dir)
    assert qwen2.config.attention_bias
    assert qwen2.model.model.layers[0].self_attn.qkv_proj.bias is not None


def test_dtype_override(tiny_qwen3_dir):
    loaded = load_checkpoint(tiny_qwen3_dir, dtype="bfloat16")
    assert loaded.config.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.fingerprint != load_checkpoint(tiny_qwen3_dir).fingerprint
    with pytest.raises(CheckpointError, match="float64"):
        load_checkpoint(tiny_qwen3_dir, dtype="float64")


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, tiny_llama_dir):
    sharded = make_model(tmp_path / "sharded", arch="llama", preset="tiny", rope_scaling=True,
                         max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = load_checkpoint(sharded).model.state_dict()
    b = load_checkpoint(tiny_llama_dir).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fingerprint_is_stable_across_processes(tiny_qwen3_dir, tiny_qwen2_dir):
    here = load_checkpoint(tiny_qwen3_dir).fingerprint
    code = ("import sys, torch; from pathlib import Path; "
            "from workers.engine.loader import checkpoint_fingerprint; "
            "print(checkpoint_fingerprint(Path(sys.argv[1]), torch.float32))")
    there = subprocess.run([sys.executable, "-c", code, str(tiny_qwen3_dir)], check=True,
                           capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert there.stdout.strip() == here
    assert load_checkpoint(tiny_qwen2_dir).fingerprint != here


def test_fingerprint_tells_different_weights_apart(tmp_path):
    a = make_model(tmp_path / "a", arch="qwen3", preset="tiny", seed=1)
    b = make_model(tmp_path / "b", arch="qwen3", preset="tiny", seed=2)
    from workers.engine.loader import checkpoint_fingerprint

    assert checkpoint_fingerprint(a, torch.float32) != checkpoint_fingerprint(b, torch.float32)


def test_missing_config(qwen3_copy):
    (qwen3_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_checkpoint(qwen3_copy)


def test_no_safetensors(qwen3_copy):
    (qwen3_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_checkpoint(qwen3_copy)


def test_unknown_architecture_lists_supported(qwen3_copy):
    path = qwen3_copy / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = ["MambaForCausalLM"]
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(qwen3_copy)
    message = str(err.value)
    assert "config.json" in message and "MambaForCausalLM" in message
    assert "Qwen3ForCausalLM" in message and "LlamaForCausalLM" in message


def _rewrite_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_shape_mismatch_names_file_tensor_and_shapes(qwen3_copy):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_weights(qwen3_copy, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(qwen3_copy)
    message = str(err.value)
    assert "model.safetensors" in message and name in message
    assert "(32, 64)" in message and "(16, 64)" in message


def test_missing_tensor_is_named(qwen3_copy):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_weights(qwen3_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        load_checkpoint(qwen3_copy)


def test_unexpected_tensor_is_named(qwen3_copy):
    _rewrite_weights(qwen3_copy, lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.extra.weight'"):
        load_checkpoint(qwen3_copy)
