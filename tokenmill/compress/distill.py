"""`tokenmill distill`: knowledge distillation of a student (typically a pruned model) from a
teacher on plain text — temperature-scaled KL between their next-token distributions (soft
targets, Hinton et al.), optionally plus an MSE on the final hidden states when their widths
match. CPU-sized: one sequence at a time with gradient accumulation, AdamW, warmup + cosine
schedule, token embeddings (and a tied output head) frozen. `qat` trains through the same loop.

Training state is checkpointed every `save_every` steps into a working directory (each file
replaced atomically); a rerun of the same command resumes from it with the same data order.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
from dataclasses import asdict, dataclass
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from tokenmill.compress.evaluate import perplexity
from tokenmill.models.llama import CausalLM


@dataclass(frozen=True)
class DistillConfig:
    steps: int
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 2e-4
    warmup_steps: int = 10
    temperature: float = 2.0
    hidden_loss_weight: float = 0.0
    eval_every: int = 50
    eval_tokens: int = 4096
    save_every: int = 25
    seed: int = 0

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 8:
            raise ValueError("need --steps >= 1, --batch-size >= 1 and --seq-len >= 8.")
        if not 0 < self.lr < 1 or self.temperature <= 0 or self.hidden_loss_weight < 0:
            raise ValueError("need 0 < --lr < 1, --temperature > 0 and --hidden-loss-weight >= 0.")
        if self.eval_every < 0 or self.save_every < 1:
            raise ValueError("need --eval-every >= 0 and --save-every >= 1.")


def check_pair(teacher: CausalLM, student: CausalLM, hidden_loss_weight: float) -> None:
    if teacher.cfg.vocab_size != student.cfg.vocab_size:
        raise ValueError(f"teacher and student vocabularies differ ({teacher.cfg.vocab_size} vs "
                         f"{student.cfg.vocab_size}); distillation on logits needs the same tokenizer.")
    if hidden_loss_weight and teacher.cfg.hidden_size != student.cfg.hidden_size:
        raise ValueError("--hidden-loss-weight needs teacher and student of the same hidden size.")


def lr_at(step: int, cfg: DistillConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(step: int, token_ids: list[int], cfg: DistillConfig) -> list[torch.Tensor]:
    """The windows of step `step`: a function of (seed, step) only, so a resumed run sees the
    same data as an uninterrupted one."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    hi = len(token_ids) - cfg.seq_len
    return [torch.tensor(token_ids[s:s + cfg.seq_len]) for s in (rng.randrange(0, hi + 1) for _ in range(cfg.batch_size))]


def trainable(student: CausalLM, lrs: dict[str, float] | None = None) -> list[dict]:
    """Optimizer groups: every parameter but the embedding, at the schedule's learning rate, except
    those whose name ends in a key of `lrs`, which get that peak rate (0: frozen)."""
    lrs = lrs or {}
    groups: dict[float | None, list[torch.nn.Parameter]] = {}
    for name, p in student.named_parameters():
        peak = next((lr for suffix, lr in lrs.items() if name.endswith(suffix)), None)
        p.requires_grad_(not name.startswith("model.embed_tokens") and peak != 0)
        if p.requires_grad:
            groups.setdefault(peak, []).append(p)
    return [{"params": ps, "peak": peak} for peak, ps in groups.items()]


def _loss(teacher: CausalLM, student: CausalLM, ids: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    pos = torch.arange(ids.numel())
    with torch.no_grad():
        t_hidden = teacher(ids, pos)
        t_logp = F.log_softmax(teacher.compute_logits(t_hidden) / cfg.temperature, dim=-1)
    s_hidden = student(ids, pos)
    s_logp = F.log_softmax(student.compute_logits(s_hidden) / cfg.temperature, dim=-1)
    loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * cfg.temperature ** 2
    if cfg.hidden_loss_weight:
        loss = loss + cfg.hidden_loss_weight * F.mse_loss(s_hidden, t_hidden)
    return loss


def distill(teacher: CausalLM, student: CausalLM, train_ids: list[int], eval_ids: list[int] | None,
            cfg: DistillConfig, work_dir: str, progress: bool = True, lrs: dict[str, float] | None = None,
            desc: str = "distill", step_context: Callable[[], ContextManager] = contextlib.nullcontext
            ) -> list[dict]:
    """Train `student` in place for `cfg.steps` steps (resuming from `work_dir` if it holds a
    checkpoint of the same configuration); returns the history of losses and perplexities.
    `lrs`: peak learning rates by parameter-name suffix, overriding `cfg.lr` (see `trainable`);
    `step_context`: entered around each step's sequences (QAT computes its weights there once)."""
    cfg.validate()
    check_pair(teacher, student, cfg.hidden_loss_weight)
    if len(train_ids) <= cfg.seq_len:
        raise ValueError(f"the training text has {len(train_ids)} tokens; need more than --seq-len {cfg.seq_len}.")
    teacher.eval()
    groups = trainable(student, lrs)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
    start, history = _resume(work_dir, cfg, student, opt)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=desc, unit="step")
    if start == 0 and eval_ids and cfg.eval_every:
        history.append({"step": 0, **_eval(teacher, student, eval_ids)})
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg) * (1.0 if group["peak"] is None else group["peak"] / cfg.lr)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        with step_context():
            for ids in batch_at(step, train_ids, cfg):
                loss = _loss(teacher, student, ids, cfg) / cfg.batch_size
                loss.backward()
                total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        record = {"step": step + 1, "loss": round(total, 5), "lr": lr_at(step, cfg)}
        if eval_ids and cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            record.update(_eval(teacher, student, eval_ids))
        history.append(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"kl {total:.4f}" + (f" ppl {record['eval_ppl']:.2f}" if "eval_ppl" in record else ""))
        if (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            _save(work_dir, cfg, student, opt, step + 1, history)
    if bar is not None:
        bar.close()
    for p in student.parameters():
        p.requires_grad_(False)
    return history


def _eval(teacher: CausalLM, student: CausalLM, eval_ids: list[int]) -> dict[str, float]:
    """Perplexity on the held-out text, and the KL from the teacher there: the distance the
    training closes, free of how well either model happens to fit that text."""
    with torch.no_grad(), parametrize.cached():
        ppl = perplexity(student, eval_ids, context_len=512, stride=256, progress=False)["perplexity"]
        return {"eval_ppl": round(ppl, 4), "eval_kl": round(held_out_kl(teacher, student, eval_ids), 5)}


@torch.no_grad()
def held_out_kl(teacher: CausalLM, student: CausalLM, token_ids: list[int], window: int = 512) -> float:
    """Mean per-token KL(teacher || student) at temperature 1 over consecutive windows."""
    total, count = 0.0, 0
    for s in range(0, len(token_ids) - 1, window):
        ids = torch.tensor(token_ids[s:s + window])
        pos = torch.arange(ids.numel())
        t = F.log_softmax(teacher.compute_logits(teacher(ids, pos)), dim=-1)
        st = F.log_softmax(student.compute_logits(student(ids, pos)), dim=-1)
        total += float(F.kl_div(st, t, log_target=True, reduction="sum"))
        count += ids.numel()
    return total / count


def _trainable_state(student: CausalLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in student.named_parameters() if not n.startswith("model.embed_tokens")}


def _save(work_dir: str, cfg: DistillConfig, student: CausalLM, opt, step: int, history: list[dict]) -> None:
    os.makedirs(work_dir, exist_ok=True)
    tmp = os.path.join(work_dir, "state.pt.tmp")
    torch.save({"step": step, "config": asdict(cfg), "student": _trainable_state(student),
                "optimizer": opt.state_dict(), "history": history}, tmp)
    os.replace(tmp, os.path.join(work_dir, "state.pt"))
    with open(os.path.join(work_dir, "progress.json"), "w", encoding="utf-8") as f:
        json.dump({"step": step, "steps": cfg.steps, "last": history[-1]}, f)


def _resume(work_dir: str, cfg: DistillConfig, student: CausalLM, opt) -> tuple[int, list[dict]]:
    path = os.path.join(work_dir, "state.pt")
    if not os.path.exists(path):
        return 0, []
    state = torch.load(path, weights_only=True)
    if state["config"] != asdict(cfg):
        raise ValueError(f"{work_dir} holds a checkpoint of a run with other settings ({state['config']}); "
                         "rerun with the same flags to resume, or delete that directory to start afresh.")
    params = dict(student.named_parameters())
    for name, t in state["student"].items():
        if name not in params or params[name].shape != t.shape:
            raise ValueError(f"{work_dir} holds a checkpoint of another student model ({name}).")
        params[name].data.copy_(t)
    opt.load_state_dict(state["optimizer"])
    return state["step"], state["history"]
