"""Response pieces shared by whole and streamed answers: usage, timings, logprobs."""
from __future__ import annotations

from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.server import protocol as P


class Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.completion += sum(len(o.token_ids) for o in out.outputs)
        self.cached += out.metrics.num_cached_tokens if out.metrics else 0

    def model(self) -> P.Usage:
        return P.Usage(prompt_tokens=self.prompt, completion_tokens=self.completion,
                       total_tokens=self.prompt + self.completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=self.cached))


def timings(out: RequestOutput | PoolingRequestOutput) -> P.Timings | None:
    """Why was this request slow; a pooling request's ttft is when its vector was ready."""
    m = out.metrics
    if m is None:
        return None
    end = m.finished_time or m.last_token_time
    ntok = max(len(o.token_ids) for o in out.outputs) if isinstance(out, RequestOutput) else 0
    decode = None
    if m.first_token_time is not None and end is not None and end > m.first_token_time and ntok > 1:
        decode = (ntok - 1) / (end - m.first_token_time)
    return P.Timings(queue_time=None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time,
                     ttft=None if m.first_token_time is None else m.first_token_time - m.arrival_time,
                     decode_tokens_per_s=decode, e2e=None if end is None else end - m.arrival_time,
                     cached_prompt_tokens=m.num_cached_tokens, preemptions=m.num_preemptions,
                     draft_tokens=m.num_draft_tokens, accepted_draft_tokens=m.num_accepted_tokens)


def token_str(client, tid: int) -> str:
    return client.tokenizer.decode([tid], skip_special_tokens=False) if client.tokenizer else str(tid)


def top_alternatives(entry: dict, k: int) -> list:
    """A position's top-k alternatives, best first (the sampled token is in `entry` even when it
    ranks below k)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda kv: kv[1].rank)


def completion_logprobs(o, client, k: int, start: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = 0
    for tid, entry in zip(o.token_ids[start:], (o.logprobs or [])[start:]):
        s = token_str(client, tid)
        tokens.append(s)
        lps.append(entry[tid].logprob)
        tops.append({token_str(client, t): lp.logprob for t, lp in top_alternatives(entry, k)})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(o, client, k: int, start: int = 0) -> dict:
    content = []
    for tid, entry in zip(o.token_ids[start:], (o.logprobs or [])[start:]):
        s = token_str(client, tid)
        top = [{"token": (ts := token_str(client, t)), "logprob": lp.logprob, "bytes": list(ts.encode())}
               for t, lp in top_alternatives(entry, k)]
        content.append({"token": s, "logprob": entry[tid].logprob, "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}
