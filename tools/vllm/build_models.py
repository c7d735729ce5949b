"""Builds the tiny random-weight models the vLLM tier serves, offline and deterministically.

Runs inside the vLLM venv (torch, transformers, tokenizers), with ``ROLLOUT_VLLM_TORCHVISION=stub`` so
the Qwen2-VL processors can be built; see ``build_models.sh``. Writes into OUT_DIR:

* ``tiny-llama``     LlamaForCausalLM
* ``tiny-qwen3moe``  Qwen3MoeForCausalLM, 8 experts, top-2
* ``tiny-qwen2vl``   Qwen2VLForConditionalGeneration with a Qwen2VLProcessor

All share one byte-level BPE tokenizer (vocab 2048) trained here on local text, with the special tokens
and ids of the reference doc (section 9.4) and a ChatML chat template.
"""

# The project's venv has neither torch nor transformers: these imports are untyped for mypy there.
# mypy: disable-error-code="import-not-found,import-untyped,no-untyped-call,no-any-return,misc"

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB_SIZE = 2048
MAX_POSITIONS = 4096
SPECIAL_TOKENS = [
    "<|endoftext|>",  # 0, BOS
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2, EOS
    "<|pad|>",  # 3
    "<|vision_start|>",  # 4
    "<|vision_end|>",  # 5
    "<|image_pad|>",  # 6
    "<|video_pad|>",  # 7
]
BOS_ID, EOS_ID, PAD_ID = 0, 2, 3
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = 4, 5, 6, 7

# ChatML. List-valued content: text parts verbatim, each image (video) part becomes one placeholder.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url', 'image_pil', 'image_embeds'] -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. What is two plus two? Two plus two is four. "
    "A rollout service asks an inference engine for samples, streams their tokens back with log "
    "probabilities, and pauses generation while the trainer updates the weights of the model. "
    "Describe the picture in one short sentence. It shows a small red square on a white background. "
)

# One base for the three text stacks: hidden 64 with 2 heads of 32 (the CPU attention backend needs a
# head size of 32, 64, 80, ...), 1 KV head, peaky random logits (initializer_range 0.2).
TEXT_BASE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}


def training_text() -> list[str]:
    """The first 60 standard-library modules (sorted) plus an English paragraph: local, fixed text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))[:60]]
    texts.extend([ENGLISH] * 40)
    return texts


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual = tok.token_to_id(token)
        if actual != expected_id:
            raise RuntimeError(f"special token {token} got id {actual}, expected {expected_id}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    tokenizer.save_pretrained(out)
    add_template_to_tokenizer_config(out)


def add_template_to_tokenizer_config(out: Path) -> None:
    """Older readers look for the chat template in tokenizer_config.json only."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)


def build_llama(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    torch.manual_seed(1234)
    config = LlamaConfig(**TEXT_BASE, head_dim=32, dtype="bfloat16")
    save_model(LlamaForCausalLM(config), tokenizer, out)


def build_qwen3moe(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    torch.manual_seed(2345)
    config = Qwen3MoeConfig(
        **TEXT_BASE,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        dtype="bfloat16",
    )
    save_model(Qwen3MoeForCausalLM(config), tokenizer, out)


def build_qwen2vl(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    torch.manual_seed(3456)
    text_config = {**TEXT_BASE, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}}
    vision_config = {
        "depth": 1,
        "embed_dim": 64,
        "hidden_size": 64,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    save_model(Qwen2VLForConditionalGeneration(config), tokenizer, out)
    pixels = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}
    image_processor = Qwen2VLImageProcessor(**pixels)
    try:
        from transformers import Qwen2VLVideoProcessor

        video_processor = Qwen2VLVideoProcessor(**pixels)
    except Exception as exc:  # torchvision hidden: the image processor alone is the fallback
        print(f"build_models: no video processor ({exc}); saving the image processor only")
        image_processor.save_pretrained(out)
        return
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)  # rewrites tokenizer_config.json without the template
    add_template_to_tokenizer_config(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        raise SystemExit("run offline: HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 (see build_models.sh)")
    torch.use_deterministic_algorithms(True)
    out: Path = args.out_dir
    tokenizer = build_tokenizer()
    for name, build in (
        ("tiny-llama", build_llama),
        ("tiny-qwen3moe", build_qwen3moe),
        ("tiny-qwen2vl", build_qwen2vl),
    ):
        build(tokenizer, out / name)
        print(f"build_models: {out / name}")


if __name__ == "__main__":
    main()
