"""Labels: reading `--labels`, and what the scores say about them (label mass, predictions per label)."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kevscore.errors import KevscoreError, listed

LOW_MASS = 0.1  # below this label mass the labels are not what the model would answer (" Yes", "yes")


def parse_labels(text: str) -> list[str]:
    """`Yes,No` -> ['Yes', 'No']: split at commas, surrounding spaces stripped. A label in double quotes is
    taken as written (`" Yes"," No"` keeps the leading spaces; a quoted label may hold a comma). A JSON array of
    strings (`["Yes", "No"]`, as a CSV's labels cell) is its strings."""
    try:
        given = json.loads(text) if text.lstrip().startswith("[") else None
    except ValueError:
        given = None  # no JSON: labels that begin with '[' ("[A],[B]"), split at commas
    if given is not None:
        if isinstance(given, list) and all(isinstance(label, str) for label in given):
            return given
        raise KevscoreError(f"--labels {text}: a JSON array, but not of strings")
    labels, rest = [], text
    while True:
        rest = rest.lstrip()
        if rest.startswith('"'):
            if (end := rest.find('"', 1)) < 0:
                raise KevscoreError(f"--labels {text}: a quote is not closed")
            label, rest = rest[1:end], rest[end + 1:].lstrip()
            if rest and not rest.startswith(","):
                raise KevscoreError(f"--labels {text}: text after a closing quote; quote the whole label")
        else:
            label = rest.partition(",")[0]
            rest, label = rest[len(label):], label.strip()
        labels.append(label)
        if not rest:
            return labels
        rest = rest[1:]  # the comma


@dataclass(slots=True)
class LabelTally:
    """Label mass and predictions over an output's rows, counted as its chunks go by (4 bytes a row); rows whose
    probabilities are not finite (the model produced NaN/inf) are counted apart, their label mass left out."""
    predictions: Counter = field(default_factory=Counter)
    masses: list[np.ndarray] = field(default_factory=list)
    non_finite: int = 0

    def add(self, chunk: pa.Table) -> pa.Table:
        self.predictions.update(p for p in chunk.column("prediction").to_pylist() if p is not None)
        probs = chunk.column("probs")
        bad = np.zeros(len(chunk), bool)
        bad[pc.list_parent_indices(probs).to_numpy()[~np.isfinite(pc.list_flatten(probs).to_numpy())]] = True
        mass = chunk.column("label_mass").to_numpy().astype(np.float32)
        bad |= ~np.isfinite(mass)
        self.non_finite += int(bad.sum())
        self.masses.append(mass[~bad])
        return chunk

    def summary(self) -> dict:
        """min, median and rows under LOW_MASS of the (finite) label mass; rows of non-finite probabilities;
        predictions per label, most first."""
        if not self.masses or not len(mass := np.concatenate(self.masses)):
            return {"label_mass_min": None, "label_mass_median": None, "low_mass_rows": 0,
                    "non_finite_rows": self.non_finite, "predictions": {}}
        return {"label_mass_min": float(mass.min()), "label_mass_median": float(np.median(mass)),
                "low_mass_rows": int((mass < LOW_MASS).sum()), "non_finite_rows": self.non_finite,
                "predictions": dict(self.predictions.most_common())}


def low_mass_warning(summary: dict, rows: int, labels: list[str]) -> str | None:
    """A warning when rows' probabilities are not finite (the model produced NaN/inf), and when most rows'
    labels hold little probability: a wrong label (case, spelling, a space); one line."""
    bad = summary.get("non_finite_rows", 0)
    nan = f"{bad:,} rows have non-finite probabilities (the model produced NaN/inf): check the model and --dtype"
    low = summary.get("low_mass_rows", 0)
    if not rows or low * 2 <= rows - bad:
        return nan if bad else None
    named = listed([repr(label) for label in labels], 5, "labels")
    return (f"{nan}; " if bad else "") + (
        f"the labels ({named} unless a labels column says otherwise) hold less than "
        f"{LOW_MASS:.0%} of the model's probability on {low:,} of {rows:,} rows (median label mass "
        f"{summary['label_mass_median']:.2g}): the model would answer with other tokens; check the labels' "
        "spelling, case and leading spaces (a label with a leading space is quoted: --labels '\" Yes\",\" No\"')")
