"""Tiny, random stand-ins for the red-teaming models, saved like real checkpoints and loaded by the
real loaders: a GPT-2-style attacker and victim (byte-level BPE, ``<|endoftext|>`` as EOS, no pad
token, no chat template), a two-label toxicity classifier (``nothate`` / ``hate``) whose tokenizer
adds ``[CLS]`` / ``[SEP]`` as RoBERTa's does, and a sentence-transformers embedder (a tiny BERT
with mean pooling). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

EOS = "<|endoftext|>"
CLS, SEP, PAD = "[CLS]", "[SEP]", "[PAD]"
HIDDEN = 32  # width of the encoders (classifier and embedder)
CORPUS = [
    "1. Write a short poem about the sea at night.\n2. Explain how a bicycle gear system works.",
    "3. Give three tips for keeping houseplants healthy.\n4. Tell me how to bake bread at home.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\nDescribe your favourite city.\n\n### Response:\nI like the old town and the river.",
    "I hate waiting. You are terrible and stupid. That is kind, thank you, have a nice day.",
    "why how what when where who people friends neighbours weather music film book 0 1 2 3 4 5 6 7 8 9",
]


def _train_bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def build_lm_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's shape: EOS (= BOS) ``<|endoftext|>``, no pad token, no chat template."""
    return PreTrainedTokenizerFast(tokenizer_object=_train_bpe([EOS]), eos_token=EOS, bos_token=EOS)


def build_gpt2(path: Path, seed: int = 0, eager_eos: bool = False, shape: dict | None = None) -> Path:
    """A random 2-layer GPT-2 with its tokenizer at ``path``. ``eager_eos``: the model puts almost all
    its probability on EOS at every step (its final layer norm emits one constant vector that points
    at EOS's embedding), so only ``min_new_tokens`` keeps its completions from being empty.
    ``shape`` overrides the widths and depth (GPT2Config keys: ``n_embd``, ``n_layer``, ``n_head``)."""
    tokenizer = build_lm_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        **{"n_embd": 32, "n_layer": 2, "n_head": 2, **(shape or {})},
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    if eager_eos:
        with torch.no_grad():
            final = model.transformer.ln_f
            final.weight.zero_()
            final.bias.copy_(torch.randn(config.n_embd))
            # logits = h . wte (tied head): EOS's logit becomes 30, the others stay near 0
            bias = final.bias
            model.transformer.wte.weight[tokenizer.eos_token_id] = 30 * bias / bias.dot(bias)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def build_encoder_tokenizer() -> PreTrainedTokenizerFast:
    """RoBERTa's shape: every text, the empty one too, becomes ``[CLS] ... [SEP]``."""
    tok = _train_bpe([PAD, CLS, SEP])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", special_tokens=[(CLS, tok.token_to_id(CLS)), (SEP, tok.token_to_id(SEP))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token=CLS, sep_token=SEP, pad_token=PAD, model_max_length=128
    )


def _bert_config(tokenizer, **extra) -> BertConfig:
    shape = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    return BertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        **{**shape, **extra},
    )


def build_classifier(path: Path, seed: int = 0, shape: dict | None = None) -> Path:
    """A random two-label classifier (``{0: nothate, 1: hate}``), initialised with large weights so
    that p(hate) spreads over (0, 1) across texts instead of sitting at 0.5 for all of them.
    ``shape`` overrides the widths and depth (BertConfig keys)."""
    tokenizer = build_encoder_tokenizer()
    labels = {"id2label": {0: "nothate", 1: "hate"}, "label2id": {"nothate": 0, "hate": 1}}
    config = _bert_config(tokenizer, initializer_range=0.2, **labels, **(shape or {}))
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        model.classifier.weight.mul_(3.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def build_embedder(path: Path, seed: int = 0) -> Path:
    """A sentence-transformers model (tiny BERT + mean pooling) saved in its own format, so that
    ``SentenceTransformer(path)`` loads it offline."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 moved the modules; older versions (>= 3) have them here only
        from sentence_transformers.sentence_transformer import modules as st_models
    except ImportError:
        from sentence_transformers import models as st_models

    path = Path(path)
    tokenizer = build_encoder_tokenizer()
    torch.manual_seed(seed)
    bert_dir = path.parent / f"{path.name}-bert"
    BertModel(_bert_config(tokenizer)).save_pretrained(bert_dir)
    tokenizer.save_pretrained(bert_dir)
    encoder = st_models.Transformer(str(bert_dir), max_seq_length=64)
    pooling = st_models.Pooling(HIDDEN, pooling_mode="mean")
    SentenceTransformer(modules=[encoder, pooling], device="cpu").save(str(path))
    return path


def build_redteam_models(root: Path) -> dict[str, Path]:
    """Every model the redteam task needs, under ``root``: attacker, eager-EOS attacker, victim,
    classifier and embedder."""
    root = Path(root)
    return {
        "attacker": build_gpt2(root / "attacker", seed=0),
        "eager_attacker": build_gpt2(root / "eager-attacker", seed=1, eager_eos=True),
        "victim": build_gpt2(root / "victim", seed=2),
        "classifier": build_classifier(root / "classifier", seed=3),
        "embedder": build_embedder(root / "embedder", seed=4),
    }
