"""Write a small random Hugging Face checkpoint: weights, config, generation config and a
byte-level BPE tokenizer with a ChatML chat template.

Nothing is downloaded: tests and benchmarks build their own models with this, and
`llmq make-model` calls `make_model`. The checkpoint loads both with `transformers`
(the reference the exactness tests compare against) and with `workers.engine.loader`.

    python -m workers.engine.make_model DIR --arch qwen3 --preset tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
}


@dataclass(slots=True, frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    init_std: float  # std of the random weights: large enough that greedy argmax varies


PRESETS = {
    "tiny": Preset(64, 2, 4, 2, 16, 128, 512, 2048, 0.1),
    "small": Preset(256, 4, 8, 2, 32, 768, 1024, 4096, 0.05),
    "100m": Preset(768, 12, 12, 4, 64, 2048, 32000, 4096, 0.02),
}

# Training text for the tokenizer: plain English, enough for a few hundred merges.
CORPUS = """\
The river runs past the old mill, where the miller keeps his stones turning from dawn
until the light fades over the hills. Children walk along the bank to school each morning,
counting boats and herons, and the baker opens her shop when the bells ring seven.
In winter the water freezes near the edges, and the town gathers to skate and to talk about
the harvest, the prices of grain, the weather that is coming, and the news from the city.
A good question deserves a careful answer. When you write a program, read it again the
next day: the names should say what things are, and the comments should say why they are.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten appear in lists.
The quick brown fox jumps over the lazy dog while the small cat sleeps in the warm sun.
Scientists measure the speed of light, the weight of atoms and the age of distant stars.
Engineers build bridges, engines, networks and machines that serve people every day.
Music, painting and poetry help people share what they feel and what they remember.
She asked him what time the train would leave, and he said it would leave at noon.
They planted apples, pears, plums and cherries in the garden behind the stone house.
Hello! How are you today? I am fine, thank you. What would you like to learn about?
Please summarize the following text in one sentence, then list three key points.
The system answers questions, writes stories, translates sentences and explains ideas.
Water boils at one hundred degrees at sea level, and freezes at zero degrees Celsius.
Every morning the market fills with voices, colours and the smell of fresh bread.
"""


# Syllables of the filler words that fill the tokenizer up to the model's vocabulary.
_ONSETS = "b d f g k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()


def _filler_words() -> Iterator[str]:
    """' ba', ' be', ..., ' baba', ...: pronounceable words, in a fixed order."""
    syllables = [c + v for c in _ONSETS for v in _VOWELS]
    for length in itertools.count(1):
        for parts in itertools.product(syllables, repeat=length):
            yield "\u0120" + "".join(parts)  # byte-level BPE spells a leading space as Ġ


def _pad_vocab(tokenizer, vocab_size: int):  # tokenizers.Tokenizer -> same
    """The tokenizer with filler words appended to its BPE vocabulary, `vocab_size` in all.

    NOTE: the corpus yields only a few hundred merges, fewer than a preset's vocabulary.
    Without filler, ids past the trained vocabulary decode to nothing, so a random model
    (which samples every id) emits token events with empty text. Filler entries have no
    merge that produces them: encoding is unchanged, and every id decodes to a word.
    """
    from tokenizers import Tokenizer

    state = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    words = (w for w in _filler_words() if w not in vocab)
    while len(vocab) < vocab_size:
        vocab[next(words)] = len(vocab)
    return Tokenizer.from_str(json.dumps(state))


def _train_tokenizer(out_dir: Path, vocab_size: int) -> tuple[dict[str, int], int]:
    """Train a byte-level BPE tokenizer of exactly `vocab_size` tokens (filler words after
    the trained ones) and save it for `AutoTokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the lines changes pair counts only, which is enough to rank merges.
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    num_trained = tokenizer.get_vocab_size()
    if num_trained < vocab_size:
        logger.info("trained %d tokens; %d filler words fill the vocabulary", num_trained,
                    vocab_size - num_trained)
        tokenizer = _pad_vocab(tokenizer, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    # never None: the trainer puts every special token in the vocabulary
    ids = {t: cast(int, tokenizer.token_to_id(t)) for t in SPECIAL_TOKENS}
    return ids, tokenizer.get_vocab_size()


def _hf_config(arch: str, p: Preset, ids: dict[str, int], tie: bool, rope_scaling: bool):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "intermediate_size": p.intermediate_size,
        "vocab_size": p.vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "initializer_range": p.init_std,
    }
    # rope_theta: a keyword of the transformers 4.x configs that 5.x still takes (folding it
    # into rope_parameters) but leaves out of its configs' typed signatures
    if arch == "qwen3":
        return Qwen3Config(head_dim=p.head_dim, rope_theta=1_000_000.0,  # type: ignore[call-arg]
                           **common)
    if arch == "qwen2":
        if p.hidden_size != p.num_heads * p.head_dim:
            raise ValueError("qwen2 derives head_dim from hidden_size / num_heads")
        return Qwen2Config(rope_theta=1_000_000.0, **common)  # type: ignore[call-arg]
    if arch == "llama":
        extra: dict[str, Any] = {}
        if rope_scaling:
            extra["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # small so the scaled band covers frequencies the tests exercise
                "original_max_position_embeddings": 64,
            }
        return LlamaConfig(head_dim=p.head_dim, rope_theta=500_000.0,  # type: ignore[call-arg]
                           **common, **extra)
    raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")


def _randomize(model, std: float, seed: int) -> None:
    """Normal weights (std) and norm gains near 1, so outputs depend on the context."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(std * torch.randn(param.shape, generator=gen))


def make_model(
    out_dir: str | Path,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    rope_scaling: bool = False,
    max_shard_size: str | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a random `arch` checkpoint of `preset` size into `out_dir` and return its path.

    `rope_scaling=True` (llama only) adds a `llama3` rope scaling; `max_shard_size`
    (e.g. "200KB") writes a sharded checkpoint with a `model.safetensors.index.json`.
    The checkpoint is written to a temporary directory beside `out_dir` and renamed into
    place, so a failure leaves nothing half-written. An `out_dir` that holds anything
    raises `FileExistsError` unless `overwrite`. `progress` hears each step's name.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if rope_scaling and arch != "llama":
        raise ValueError("rope_scaling=True is only offered for arch='llama'")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    out = Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        what = "a checkpoint" if (out / "config.json").exists() else "files"
        raise FileExistsError(f"{out} already holds {what}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep the served checkpoint from other users
    try:
        _write_checkpoint(tmp, arch, PRESETS[preset], preset, seed, dtype,
                          tie_word_embeddings, rope_scaling, max_shard_size,
                          progress or (lambda _step: None))
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s", out)
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; what `out` held is removed only after."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(tmp, out)  # NOTE: rename(2) replaces an empty directory atomically
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / out.name)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _write_checkpoint(out: Path, arch: str, p: Preset, preset: str, seed: int, dtype: str,
                      tie_word_embeddings: bool, rope_scaling: bool,
                      max_shard_size: str | None, progress: Callable[[str], None]) -> None:
    progress("loading torch and transformers")
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    torch_dtype = getattr(torch, dtype)
    step = f"training a {p.vocab_size}-token BPE tokenizer"
    logger.info("%s", step)
    progress(step)
    ids, tok_vocab = _train_tokenizer(out, p.vocab_size)
    # NOTE: every model id has a token: ids past the tokenizer would decode to nothing
    assert tok_vocab == p.vocab_size, (tok_vocab, p.vocab_size)

    config = _hf_config(arch, p, ids, tie_word_embeddings, rope_scaling)
    classes = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}
    torch.manual_seed(seed)
    step = f"building a random {arch} {preset} model"
    logger.info("%s", step)
    progress(step)
    model = classes[arch](config)
    _randomize(model, p.init_std, seed)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    num_params = sum(t.numel() for t in model.parameters())
    step = f"saving {num_params / 1e6:.1f}M parameters ({dtype})"
    logger.info("%s", step)
    progress(step)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos, pad_token_id=ids["<|endoftext|>"]
    ).save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a small random checkpoint.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--force", action="store_true", help="replace what OUT_DIR holds")
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--rope-scaling", action="store_true", help="llama3 rope scaling")
    parser.add_argument("--max-shard-size", default=None, help='e.g. "200MB"')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_model(
        args.out_dir,
        arch=args.arch,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        tie_word_embeddings=args.tie_word_embeddings,
        rope_scaling=args.rope_scaling,
        max_shard_size=args.max_shard_size,
        overwrite=args.force,
    )
    print(json.dumps({"model_dir": str(Path(args.out_dir).resolve())}))


if __name__ == "__main__":
    main()
