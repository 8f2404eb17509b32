"""The demo model's task: yes/no questions about short synthetic documents, seeded and balanced.

A document is a few short sentences over a fixed list of nouns (each noun at most once) and two-digit
numbers (each at most once). Three question families, each answered only by reading the document:

- mention: "Does the document mention the <noun>?"
- number:  "Is the number <n> in the document?" (absent numbers are often a present one's digits reversed)
- order:   "Does the <noun> come before the <noun>?" (both nouns are in the document)

Every family draws yes and no with equal probability. `examples(n, seed)` with the same arguments gives
the same rows on every machine (Python's `random.Random`, no hashing of strings).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

NOUNS = tuple("""
apple bag baker ball basket beans bicycle books bowls bread bus cables car cards carrots children
coffee compasses computers council database doctor dogs eggs engineers explorers family football garden
garlic grandfather harbour hotel house internet jackets jam kitchen lake letter library manager maps market
milk money mountains movie museum newspaper office onions oranges parents park photos pies potatoes
provider radio recipe rice river rolls router sailors salt schools shelf ships shoes sister soup students
tea team train vegetables water weather
""".split())

SENTENCES = (
    "We saw the {a} near the {b}.",
    "The {a} was next to the {b}.",
    "My friend talked about the {a}.",
    "Someone left the {a} by the {b}.",
    "The {a} and the {b} were there all day.",
    "Later the {a} arrived.",
    "Everyone liked the {a}.",
    "There were {n} people at the {a}.",
    "The {a} cost {n} pounds.",
    "It took {n} minutes to reach the {a}.",
    "The report counted {n} boats.",
    "In the morning it was cold and quiet.",
    "Nobody expected rain that week.",
)

QUESTIONS = {
    "mention": ("Does the document mention the {a}?", "Is the {a} mentioned?"),
    "number": ("Is the number {n} in the document?", "Does the text mention the number {n}?"),
    "order": ("Does the {a} come before the {b}?", "Is the {a} mentioned before the {b}?"),
}
FAMILIES = tuple(QUESTIONS)
ANSWERS = ("Yes", "No")


@dataclass(frozen=True, slots=True)
class Example:
    document: str
    question: str
    answer: str   # "Yes" or "No"
    family: str   # one of FAMILIES
    key_end: int  # characters of `question` up to the end of the word that decides it (its last noun or number)


def document(rng: random.Random, sentences: tuple[int, int] = (3, 12),
             vocabulary: int = len(NOUNS)) -> tuple[str, list[str], list[int]]:
    """(text, nouns in order of appearance, numbers in order of appearance) over the first `vocabulary`
    nouns. Every document has at least two nouns and one number, so each family can be asked with either
    answer; a document uses at most half of the vocabulary."""
    nouns = rng.sample(NOUNS[:vocabulary], vocabulary)
    floor = vocabulary // 2
    numbers = rng.sample(range(10, 100), 90)
    parts: list[tuple[str, list]] = []  # (sentence, its nouns and numbers in text order)

    def add(template: str, at: int) -> None:
        fill = {k: (numbers if k == "n" else nouns).pop() for k in "abn" if "{" + k + "}" in template}
        order = sorted(fill, key=lambda k: template.index("{" + k + "}"))
        parts.insert(at, (template.format(**fill), [fill[k] for k in order]))

    for _ in range(rng.randint(*sentences)):
        template = rng.choice(SENTENCES)
        if len(nouns) - template.count("{a}") - template.count("{b}") < floor:
            break
        add(template, len(parts))
    if sum(isinstance(x, str) for _, xs in parts for x in xs) < 2:
        add("The {a} and the {b} were there all day.", rng.randint(0, len(parts)))
    if not any(isinstance(x, int) for _, xs in parts for x in xs):
        add(rng.choice([t for t in SENTENCES if "{n}" in t]), rng.randint(0, len(parts)))
    items = [x for _, xs in parts for x in xs]
    return (" ".join(text for text, _ in parts), [x for x in items if isinstance(x, str)],
            [x for x in items if isinstance(x, int)])


def _reversed_or_random(rng: random.Random, present: list[int]) -> int:
    candidates = [int(str(n)[::-1]) for n in present if n % 10 and int(str(n)[::-1]) not in present]
    if candidates and rng.random() < 0.5:
        return rng.choice(candidates)
    while True:
        n = rng.randrange(10, 100)
        if n not in present:
            return n


def question(rng: random.Random, family: str, nouns: list[str], numbers: list[int],
             vocabulary: int = len(NOUNS)) -> tuple[str, str] | None:
    """(question, answer) for one family, or None when this document cannot ask it."""
    yes = rng.random() < 0.5
    phrasing = rng.choice(QUESTIONS[family])
    if family == "mention":
        if yes and not nouns:
            return None
        a = rng.choice(nouns) if yes else rng.choice([w for w in NOUNS[:vocabulary] if w not in nouns])
        return phrasing.format(a=a), ANSWERS[not yes]
    if family == "number":
        if yes and not numbers:
            return None
        n = rng.choice(numbers) if yes else _reversed_or_random(rng, numbers)
        return phrasing.format(n=n), ANSWERS[not yes]
    if len(nouns) < 2:
        return None
    i, j = sorted(rng.sample(range(len(nouns)), 2))
    a, b = (nouns[i], nouns[j]) if yes else (nouns[j], nouns[i])
    return phrasing.format(a=a, b=b), ANSWERS[not yes]


def _key_end(question: str) -> int:
    """End of the question's last noun or number (the word its answer turns on)."""
    words = [(w.strip("?"), i) for i, w in _words(question)]
    return max(i + len(w) for w, i in words if w in NOUNS or w.isdigit())


def _words(text: str):
    i = 0
    for w in text.split(" "):
        yield i, w
        i += len(w) + 1


def examples(n: int, seed: int, families: tuple[str, ...] = FAMILIES, per_document: int = 1,
             sentences: tuple[int, int] = (3, 12), vocabulary: int = len(NOUNS)) -> list[Example]:
    """`n` examples, `per_document` questions on each document (families drawn uniformly), documents of
    `sentences` (min, max) sentences over the first `vocabulary` nouns (training curricula shrink both);
    a document's questions are consecutive."""
    rng = random.Random(seed)
    out: list[Example] = []
    while len(out) < n:
        text, nouns, numbers = document(rng, sentences, vocabulary)
        asked = set()
        tries = 0
        while len(out) < n and len(asked) < per_document and tries < 20 * per_document:
            tries += 1
            family = rng.choice(families)
            qa = question(rng, family, nouns, numbers, vocabulary)
            if qa is None or qa[0] in asked:
                continue
            asked.add(qa[0])
            out.append(Example(text, qa[0], qa[1], family, _key_end(qa[0])))
    return out
