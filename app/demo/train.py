"""Fine-tuning a small LoRA adapter on a chat dataset, on the CPU, with transformers + PEFT.

The output is an ordinary PEFT directory (adapter_config.json + adapter_model.safetensors),
the same thing a tenant would upload. Training is deterministic for a given dataset,
config and base model on one machine: every random source is seeded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.loader import load_tokenizer

logger = logging.getLogger("loraplex.demo")

# Loss is not computed on these label positions (the prompt, the padding).
IGNORE_INDEX = -100


class TrainingError(Exception):
    """Training cannot run; the message says why."""


class DatasetError(TrainingError, ValueError):
    """A dataset file that cannot be trained on; the message names the line."""


@dataclass(frozen=True, slots=True)
class ChatExample:
    messages: tuple[dict[str, str], ...]  # ends with the assistant's answer: the target


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Hyperparameters; all of them are part of the cache key (see cache.py)."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    )
    # NOTE: LoRA on the last layers only: the backward pass stops at the first adapted
    # layer, which makes a step several times cheaper, and a style (a greeting, upper
    # case, a JSON wrapper) is learnt there just as well.
    num_top_layers: int = 12
    epochs: int = 3
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 2
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TrainResult:
    steps: int
    seconds: float
    first_loss: float
    final_loss: float  # mean over the last epoch


# A trainer: (base model dir, examples, output dir, config) -> result. Tests pass fakes.
Trainer = Callable[[Path, Sequence[ChatExample], Path, TrainConfig], TrainResult]


def load_dataset(path: Path) -> list[ChatExample]:
    """A JSONL file of {"messages": [{"role", "content"}, ...]}, the last message the
    assistant's answer (OpenAI's fine-tuning format)."""
    examples: list[ChatExample] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where} is not valid JSON: {e}") from e
        messages = raw.get("messages") if isinstance(raw, dict) else None
        if not isinstance(messages, list) or len(messages) < 2:
            raise DatasetError(f"{where}: expected {{\"messages\": [...]}} with 2+ messages")
        for m in messages:
            if not (
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str)
            ):
                raise DatasetError(f"{where}: every message needs a role and a text content")
        if messages[-1]["role"] != "assistant":
            raise DatasetError(f"{where}: the last message must be the assistant's answer")
        examples.append(ChatExample(tuple({"role": m["role"], "content": m["content"]}
                                          for m in messages)))
    if not examples:
        raise DatasetError(f"{path.name} holds no examples")
    return examples


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def train_lora(
    base_dir: Path, examples: Sequence[ChatExample], out_dir: Path, config: TrainConfig
) -> TrainResult:
    """Train a LoRA adapter on `examples` (loss on the answers' tokens only) and save it
    as a PEFT directory in `out_dir`."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise TrainingError(
            "training LoRA adapters needs the peft package: pip install 'loraplex[demo]'"
        ) from None
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(available_cores())
    try:
        _seed_everything(config.seed)
        tokenizer = load_tokenizer(base_dir)
        rows = [_encode(tokenizer, example) for example in examples]
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        num_layers = int(model.config.num_hidden_layers)
        top = min(config.num_top_layers, num_layers)
        peft_model = get_peft_model(model, LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,  # type: ignore[arg-type]  # annotated int, floats work
            target_modules=list(config.target_modules),
            layers_to_transform=list(range(num_layers - top, num_layers)),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        ))
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = tokenizer.eos_token_id
        losses = _fit(peft_model, rows, config, int(pad_id), num_layers - top)
        # The model's name, not this machine's path to it, goes into adapter_config.json.
        peft_model.peft_config["default"].base_model_name_or_path = base_dir.name
        out_dir.mkdir(parents=True, exist_ok=True)
        peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    per_epoch = math.ceil(len(rows) / config.batch_size)
    last_epoch = losses[-per_epoch:]
    return TrainResult(
        steps=len(losses),
        seconds=time.perf_counter() - started,
        first_loss=losses[0],
        final_loss=sum(last_epoch) / len(last_epoch),
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


@dataclass(frozen=True, slots=True)
class _Row:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX on the prompt


def _encode(tokenizer: Any, example: ChatExample) -> _Row:
    """The prompt exactly as the server renders it (chat template with the generation
    prompt), then the answer and the template's end-of-turn tokens, which teach the
    adapter to stop."""
    messages = list(example.messages)
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True,
                                           tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise DatasetError("the chat template does not render the answer after the prompt")
    # NOTE: the prompt and the answer are tokenized apart, as at serving time, where the
    # answer's tokens are generated after the prompt's.
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False).input_ids)
    answer_ids = list(tokenizer(full[len(prompt):].rstrip(), add_special_tokens=False).input_ids)
    return _Row(prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids)


def _fit(model: Any, rows: list[_Row], config: TrainConfig, pad_id: int, first: int) -> list[float]:
    """Train the LoRA factors of layers first.. (the others have none); returns each
    step's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    per_epoch = math.ceil(len(rows) / config.batch_size)
    total = per_epoch * config.epochs

    def schedule(step: int) -> float:  # linear warmup, then linear decay to zero
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        return max(0.0, (total - step) / max(1, total - config.warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    decoder = model.get_base_model().model
    head = model.get_base_model().lm_head
    # NOTE: the layers below the first adapted one never change: their output is computed
    # once, and every epoch runs only the adapted layers on it.
    prefix = _frozen_prefix(decoder, rows, first, pad_id, config.batch_size)
    order = random.Random(config.seed)
    model.train()
    losses: list[float] = []
    with _only_layers(decoder, first, None, final_norm=True):
        for epoch in range(config.epochs):
            indices = list(range(len(rows)))
            order.shuffle(indices)
            for start in range(0, len(indices), config.batch_size):
                chosen = indices[start:start + config.batch_size]
                embeds, attention = _pad_hidden([prefix[i] for i in chosen])
                _, _, labels = _collate([rows[i] for i in chosen], pad_id)
                hidden = decoder(
                    inputs_embeds=embeds, attention_mask=attention, use_cache=False
                ).last_hidden_state
                # Position t predicts token t+1; only answer tokens count (and only their
                # logits are computed: the vocabulary projection is the costliest matmul).
                targets = labels[:, 1:]
                keep = targets != IGNORE_INDEX
                logits = head(hidden[:, :-1][keep])  # [N, vocab]
                loss = torch.nn.functional.cross_entropy(logits, targets[keep])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                scheduler.step()
                losses.append(float(loss.detach()))
            logger.info("epoch %d/%d: loss %.3f", epoch + 1, config.epochs,
                        sum(losses[-per_epoch:]) / per_epoch)
    model.eval()
    return losses


def _frozen_prefix(
    decoder: Any, rows: list[_Row], first: int, pad_id: int, batch_size: int
) -> list[torch.Tensor]:
    """Each row's hidden states after layers ..first-1, unpadded: [T, hidden] each."""
    out: list[torch.Tensor] = []
    with torch.no_grad(), _only_layers(decoder, 0, first, final_norm=False):
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            ids, mask, _ = _collate(batch, pad_id)
            hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False)
            # Right padding under causal attention: real tokens never see the padding.
            out.extend(hidden.last_hidden_state[i, :len(r.input_ids)].clone()
                       for i, r in enumerate(batch))
    return out


@contextlib.contextmanager
def _only_layers(
    decoder: Any, start: int, stop: int | None, *, final_norm: bool
) -> Iterator[None]:
    """Run the decoder on layers[start:stop] only, with or without its final norm; the
    model is put back as it was afterwards (PEFT saves tensors by layer index)."""
    layers, norm = decoder.layers, decoder.norm
    decoder.layers = torch.nn.ModuleList(list(layers)[start:stop])
    if not final_norm:
        decoder.norm = torch.nn.Identity()
    try:
        yield
    finally:
        decoder.layers, decoder.norm = layers, norm


def _pad_hidden(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(s.shape[0] for s in states)
    embeds = states[0].new_zeros((len(states), width, states[0].shape[1]))
    mask = torch.zeros((len(states), width), dtype=torch.long)
    for i, s in enumerate(states):
        embeds[i, :s.shape[0]] = s
        mask[i, :s.shape[0]] = 1
    return embeds, mask


def _collate(batch: list[_Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(r.input_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(batch):
        n = len(row.input_ids)
        ids[i, :n] = torch.tensor(row.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(row.labels)
    return ids, mask, labels
