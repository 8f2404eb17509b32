"""How a row's labels are scored: at the question's last token, or along continuations of it.

How a row's labels are scored. Labels of one token each: at the question's last token, one position per
row (`LastToken`). A row with a label of several tokens: along branches that continue its question with its
labels' tokens (`Continuations`), a label's log-probability the sum of its tokens' given the prompt.

A scoring cuts its rows into units (a row, or one branch of a row), which the engine batches and runs;
`device_scores` gathers what a batch's units need on the device, `finish` turns it into probabilities."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kevscore.engine.plan import Batch
from kevscore.model.prompt import Encoded

Tokens = tuple[int, ...]
Result = tuple[int, list[float], float]  # a completed row: (row, its labels' probabilities, its label mass)


def label_branches(labels: Sequence[Tokens]) -> tuple[list[Tokens], list[int]]:
    """The fewest continuations of a question that score every label: each label's tokens but its last begin
    one of them (a label of one token begins any). Returns the continuations, longest first, and each
    label's continuation. A label's token i is scored at the question's end + i of its continuation."""
    heads = [label[:-1] for label in labels]
    branches: list[Tokens] = []
    for head in sorted(set(heads), key=lambda h: (-len(h), h)):
        if not any(b[:len(head)] == head for b in branches):
            branches.append(head)
    return branches, [next(i for i, b in enumerate(branches) if b[:len(h)] == h) for h in heads]


class Scoring:
    """Rows cut into units that the engine batches: each unit a branch from its row's bank entry. A way of scoring
    (`LastToken`, `Continuations`) implements every method whose body here is its docstring."""
    units: list[int]

    def row(self, unit: int) -> int:
        """The row the unit scores."""

    def tokens(self, unit: int) -> list[int]:
        """The unit's branch tokens."""

    def scored(self, unit: int) -> int:
        """How many of the unit's last tokens are scored."""
        return 1

    def device_scores(self, runner, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """What `finish` needs of a batch, gathered on the device from its hidden states (`runner.score`)."""

    def finish(self, batch: Batch, host: torch.Tensor) -> list[Result]:
        """The rows the batch completes, from `device_scores` read back as float64."""

    def fail(self, unit: int) -> int:
        """A unit that cannot be scored (its row is reported as failed); returns how many rows it completes (a
        unit that is a whole row: 1)."""
        return 1


class LastToken(Scoring):
    """Rows whose labels are one token each: a unit is a row, scored at its question's last token."""

    def __init__(self, enc: Encoded, rows: list[int]):
        self.enc, self.units = enc, rows

    def row(self, unit: int) -> int:
        return unit

    def tokens(self, unit: int) -> list[int]:
        return self.enc.branches[unit]

    def device_scores(self, runner, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, labels + 1]: the label logits (-inf past a row's own), then the vocabulary's log-sum-exp."""
        logits, lse = runner.label_scores(hidden, [self.enc.label_ids[r] for r in batch.rows])
        return torch.cat([logits, lse[:, None]], 1)

    def finish(self, batch: Batch, host: torch.Tensor) -> list[Result]:
        logits, lse = host[:, :-1], host[:, -1]
        probs = torch.softmax(logits, -1)
        mass = torch.exp(torch.logsumexp(logits, -1) - lse)
        return [(r, probs[i, : len(self.enc.label_ids[r])].tolist(), float(mass[i])) for i, r in enumerate(batch.rows)]


class Continuations(Scoring):
    """Rows with a label of several tokens: a unit is one branch of a row, its question followed by a
    continuation (`label_branches`), scored at the question's last token and along the continuation. A row's
    labels' log-probabilities add up over its branches; it completes when all of them are scored."""

    def __init__(self, enc: Encoded, rows: list[int]):
        self.enc = enc
        plans = {r: _plan(tuple(enc.label_tokens(r))) for r in rows}  # row -> (its branches, their targets)
        self.unit_row = [r for r, (branches, _) in plans.items() for _ in branches]
        self.continuation = [b for branches, _ in plans.values() for b in branches]
        # per unit: (label, offset from the question's end, token)
        self.targets = [t for _, targets in plans.values() for t in targets]
        self.left = {r: len(branches) for r, (branches, _) in plans.items()}  # row -> its units not yet scored
        # row -> its labels' summed log-probabilities so far
        self.logprob = {r: [0.0] * len(enc.label_ids[r]) for r in rows}
        self.units = list(range(len(self.unit_row)))

    def row(self, unit: int) -> int:
        return self.unit_row[unit]

    def tokens(self, unit: int) -> list[int]:
        return self.enc.branches[self.unit_row[unit]] + list(self.continuation[unit])

    def scored(self, unit: int) -> int:
        return len(self.continuation[unit]) + 1

    def _gather(self, batch: Batch) -> tuple[list[int], list[int], list[int]]:
        """(hidden rows scored, the hidden row of each target token as an index into the first, target tokens)
        of a batch whose hidden states are [units * batch.scored, H], each unit's last `batch.scored` tokens."""
        at, which, tokens = [], [], []
        for i, u in enumerate(batch.rows):
            first = len(at)  # the unit's question end, at (i + 1) * scored - scored(u) in hidden
            at += range((i + 1) * batch.scored - self.scored(u), (i + 1) * batch.scored)
            which += [first + offset for _, offset, _ in self.targets[u]]
            tokens += [token for _, _, token in self.targets[u]]
        return at, which, tokens

    def device_scores(self, runner, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """[targets + positions]: each target token's logit, then the vocabulary's log-sum-exp at each position."""
        return runner.token_scores(hidden, *self._gather(batch))

    def finish(self, batch: Batch, host: torch.Tensor) -> list[Result]:
        """The rows whose last branch the batch holds (a row with a failed branch too: the engine drops it)."""
        _, which, tokens = self._gather(batch)
        logprob = iter((host[: len(tokens)] - host[len(tokens):][which]).tolist())  # each target's, in order
        done = []
        for u in batch.rows:
            r = self.unit_row[u]
            for label, _, _ in self.targets[u]:
                self.logprob[r][label] += next(logprob)
            if (summed := self._settle(u)) is not None:
                summed = torch.tensor(summed, dtype=torch.float64)
                done.append((r, torch.softmax(summed, 0).tolist(), float(torch.exp(torch.logsumexp(summed, 0)))))
        return done

    def fail(self, unit: int) -> int:
        return int(self._settle(unit) is not None)

    def _settle(self, unit: int) -> list[float] | None:
        """Count a unit of its row as scored; when it was the row's last, the row's summed log-probabilities."""
        r = self.unit_row[unit]
        self.left[r] -= 1
        return self.logprob.pop(r) if self.left[r] == 0 else None


@functools.lru_cache(maxsize=4096)
def _plan(labels: tuple[Tokens, ...]) -> tuple[list[Tokens], list[list[tuple[int, int, int]]]]:
    """A row's branches (continuations) and per branch its targets (label, offset, token)."""
    branches, of_label = label_branches(labels)
    targets: list[list[tuple[int, int, int]]] = [[] for _ in branches]
    for label, (tokens, b) in enumerate(zip(labels, of_label)):
        targets[b] += [(label, offset, token) for offset, token in enumerate(tokens)]
    return branches, targets


def scorings(enc: Encoded, rows: list[int]) -> list[Scoring]:
    """The rows whose labels are all one token, then the others: each group with its way of scoring."""
    one = [r for r in rows if enc.one_token_labels(r)]
    several = [r for r in rows if not enc.one_token_labels(r)]
    return ([LastToken(enc, one)] if one else []) + ([Continuations(enc, several)] if several else [])
