"""`python tests/fault_server.py serve ...`: `tokenmill serve` with injected faults, for
test_reliability.py (the product carries no fault hooks). A prompt holding token id
- POISON_NAN gets NaN logits from its third sampled token on (a fault of one request's numbers),
- POISON_SAMPLE makes the batched sampler raise whenever its row is in the batch,
- POISON_FATAL makes the whole step raise, as a kernel failing mid-batch would."""
import sys

from tokenmill import cli
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling.sampler import Sampler

POISON_FATAL, POISON_NAN, POISON_SAMPLE = 49151, 49150, 49149  # the default model's last vocabulary ids


def _poisoned(state, token: int) -> bool:
    return token in state.token_ids[:state.prompt_len]


def install() -> None:
    execute, prepare, sample = ModelRunner.execute, ModelRunner._prepare, Sampler.__call__

    def faulty_execute(self, sched):
        if any(POISON_FATAL in entry.token_ids for entry in sched.scheduled):
            raise RuntimeError("injected fault: a kernel failed mid-step")
        return execute(self, sched)

    def faulty_prepare(self, sched):
        res = prepare(self, sched)
        sample_ids = res[4]
        rows = [i for i, r in enumerate(sample_ids) if _poisoned(self.states[r], POISON_NAN)
                and len(self.states[r].token_ids) - self.states[r].prompt_len >= 2]
        if rows:
            model, compute = self.model, self.model.compute_logits

            def nan_logits(hidden):
                del model.compute_logits  # this step only
                logits = compute(hidden)
                logits[rows, 5] = float("nan")
                return logits
            model.compute_logits = nan_logits
        return res

    def faulty_sample(self, logits, rows):
        if any(POISON_SAMPLE in r.token_ids[:r.prompt_len] for r in rows):
            raise RuntimeError("injected fault: the sampler failed")
        return sample(self, logits, rows)

    ModelRunner.execute, ModelRunner._prepare, Sampler.__call__ = faulty_execute, faulty_prepare, faulty_sample


if __name__ == "__main__":
    install()
    sys.exit(cli.main(sys.argv[1:]))
