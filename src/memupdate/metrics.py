"""Pure QA metrics shared by training rewards and evaluation.

Each function reproduces a published protocol exactly, so scores are comparable with the papers:

* LoCoMo (snap-research/LoCoMo ``task_eval/evaluation.py``): :func:`locomo_f1`, :func:`locomo_token_f1`,
  :func:`normalize_locomo_answer`; and (``task_eval/gpt_utils.py``) :func:`locomo_choice_answer`.
* Mem0 (mem0ai/mem0 ``evaluation/metrics/utils.py``): :func:`mem0_f1`, :func:`bleu1`.
* SQuAD: :func:`normalize_squad`, :func:`exact_match`, :func:`sub_exact_match`, :func:`squad_f1`.
* Math-style final answers: :func:`extract_boxed`.

Nothing here needs downloaded NLTK data.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from nltk.stem import PorterStemmer
from nltk.tokenize import NLTKWordTokenizer
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

__all__ = [
    "bleu1",
    "exact_match",
    "extract_boxed",
    "locomo_choice_answer",
    "locomo_f1",
    "locomo_token_f1",
    "mem0_f1",
    "normalize_locomo_answer",
    "normalize_squad",
    "squad_f1",
    "sub_exact_match",
]

_PUNCTUATION = frozenset(string.punctuation)
_LOCOMO_STOPWORDS = re.compile(r"\b(a|an|the|and)\b")
_SQUAD_ARTICLES = re.compile(r"\b(a|an|the)\b")
_LOCOMO_ABSTAIN = ("no information available", "not mentioned")

_stem = functools.lru_cache(maxsize=65536)(PorterStemmer().stem)
_word_tokenize = NLTKWordTokenizer().tokenize
_bleu_smoothing = SmoothingFunction().method1


def _remove_punctuation(text: str) -> str:
    return "".join(ch for ch in text if ch not in _PUNCTUATION)


def token_f1(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Multiset token F1; 0.0 when nothing overlaps (so also when either side is empty)."""
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _max_over_golds(metric: Callable[[str, str], float], prediction: str, gold: str | Sequence[str]) -> float:
    golds = [gold] if isinstance(gold, str) else list(gold)
    if not golds:
        raise ValueError("no gold answers given")
    return max(metric(prediction, g) for g in golds)


# --- LoCoMo -------------------------------------------------------------------------------------


def normalize_locomo_answer(s: str) -> str:
    """
    >>> normalize_locomo_answer("The cat, and a Dog!")
    'cat dog'

    LoCoMo normalisation: drop commas, lower-case, drop punctuation, drop the words a/an/the/and,
    collapse whitespace.
    """
    s = _remove_punctuation(s.replace(",", "").lower())
    return " ".join(_LOCOMO_STOPWORDS.sub(" ", s).split())


def locomo_token_f1(prediction: str, answer: str) -> float:
    """
    >>> locomo_token_f1("painting and running", "running, painting")
    1.0

    LoCoMo token F1: normalised, Porter-stemmed, multiset overlap.
    """
    pred_tokens = [_stem(w) for w in normalize_locomo_answer(prediction).split()]
    gold_tokens = [_stem(w) for w in normalize_locomo_answer(answer).split()]
    return token_f1(pred_tokens, gold_tokens)


def locomo_f1(prediction: str, answer: str, category: int) -> float:
    """
    >>> round(locomo_f1("painting and running", "running, painting", category=1), 2)
    0.67

    LoCoMo per-category score. 1 (multi-hop): mean over comma-separated gold parts of the best F1
    against any comma-separated prediction part. 2, 4: :func:`locomo_token_f1`. 3: F1 against the
    answer's first ``;``-separated part. 5 (adversarial): 1.0 iff the prediction abstains with
    "no information available" or "not mentioned"; the answer is ignored.
    """
    if category == 1:
        pred_parts = prediction.split(",")
        gold_parts = answer.split(",")
        best = [max(locomo_token_f1(p, g) for p in pred_parts) for g in gold_parts]
        return sum(best) / len(best)
    if category in (2, 4):
        return locomo_token_f1(prediction, answer)
    if category == 3:
        return locomo_token_f1(prediction, answer.split(";")[0])
    if category == 5:
        lowered = prediction.lower()
        return 1.0 if any(phrase in lowered for phrase in _LOCOMO_ABSTAIN) else 0.0
    raise ValueError(f"unknown LoCoMo category {category!r}; expected one of 1, 2, 3, 4, 5")


def locomo_choice_answer(prediction: str, options: Mapping[str, str]) -> str:
    """
    >>> options = {"a": "Not mentioned in the conversation", "b": "a cat"}
    >>> locomo_choice_answer(" A ", options), locomo_choice_answer("(b)", options)
    ('Not mentioned in the conversation', 'a cat')
    >>> locomo_choice_answer("(a) Not mentioned", options)
    '(a) not mentioned'

    The category-5 reply as LoCoMo scores it (``get_cat_5_answer``): a question asked as the two-way
    choice ``(a) ... (b) ...`` and answered with a bare letter (one character after stripping, ``a`` if it
    contains an a, else ``b``) or a bare ``(x)`` (three characters, ``(a)`` or else ``b``) becomes the
    option's text; any other reply is returned stripped and lower-cased. ``options`` maps ``"a"`` and
    ``"b"`` to the option texts.
    """
    text = prediction.strip().lower()
    if len(text) == 1:
        return options["a"] if "a" in text else options["b"]
    if len(text) == 3:
        return options["a"] if "(a)" in text else options["b"]
    return text


# --- Mem0 ---------------------------------------------------------------------------------------


def mem0_f1(prediction: str, answer: str) -> float:
    """
    >>> mem0_f1("painting and running", "running, painting")
    0.8

    Mem0 token F1: lower-case, ``.,!?`` become spaces, whitespace split, F1 over token *sets*
    (no stemming, no stop words). 0.0 if either side has no tokens.
    """

    def tokens(text: str) -> set[str]:
        return set(text.lower().translate(str.maketrans(".,!?", "    ")).split())

    pred_tokens, gold_tokens = tokens(prediction), tokens(answer)
    if not pred_tokens or not gold_tokens:
        return 0.0
    return token_f1(list(pred_tokens), list(gold_tokens))


def bleu1(prediction: str, answer: str) -> float:
    """
    >>> round(bleu1("The cat sat", "the cat"), 4)
    0.6667

    Mem0's BLEU-1: NLTK ``sentence_bleu`` with weights (1, 0, 0, 0) and smoothing method1 over
    lower-cased Treebank word tokens (the per-sentence tokenizer of ``nltk.word_tokenize``, so no
    punkt download). 0.0 for an empty prediction.
    """
    pred_tokens = _word_tokenize(prediction.lower())
    if not pred_tokens:
        return 0.0
    gold_tokens = _word_tokenize(answer.lower())
    # NLTK returns the int 0 (without warning) when no unigram overlaps; method1 never warns.
    score = sentence_bleu([gold_tokens], pred_tokens, weights=(1, 0, 0, 0), smoothing_function=_bleu_smoothing)
    return float(score)


# --- SQuAD --------------------------------------------------------------------------------------


def normalize_squad(s: str) -> str:
    """
    >>> normalize_squad("The  Eiffel-Tower!")
    'eiffeltower'

    SQuAD normalisation: lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace.
    """
    return " ".join(_SQUAD_ARTICLES.sub(" ", _remove_punctuation(s.lower())).split())


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """
    >>> exact_match("The Beatles.", ["beatles", "Queen"])
    1.0

    1.0 if the normalised strings are equal (max over a list of golds).
    """
    return _max_over_golds(lambda p, g: float(normalize_squad(p) == normalize_squad(g)), prediction, gold)


def sub_exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """
    >>> sub_exact_match("It was in Paris, France.", "paris")
    1.0

    1.0 if, after normalisation, either string contains the other; empty strings never match.
    """

    def one(p: str, g: str) -> float:
        p, g = normalize_squad(p), normalize_squad(g)
        return float(bool(p) and bool(g) and (p in g or g in p))

    return _max_over_golds(one, prediction, gold)


def squad_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """
    >>> squad_f1("the cat sat", "a cat")
    0.6666666666666666

    SQuAD token F1 over normalised tokens (multiset, no stemming; max over a list of golds).
    """
    return _max_over_golds(
        lambda p, g: token_f1(normalize_squad(p).split(), normalize_squad(g).split()), prediction, gold
    )


# --- \boxed{} answers ----------------------------------------------------------------------------

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN = re.compile(r"[^\s$]+")


def extract_boxed(text: str) -> str | None:
    r"""
    >>> extract_boxed(r"so $x = \boxed{\frac{1}{2}}$")
    '\\frac{1}{2}'

    Content of the last ``\boxed{...}`` or ``\fbox{...}`` (nested braces allowed), or the token after
    ``\boxed `` (``\boxed 5`` gives ``'5'``). None if there is no box or the last one is unclosed.
    """
    matches = list(_BOX_COMMAND.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    while start < len(text) and text[start].isspace():
        start += 1
    if start == len(text):
        return None
    if text[start] != "{":
        if start == matches[-1].end():  # `\boxed5` is not a box; `\boxed 5` is
            return None
        token = _BARE_TOKEN.match(text, start)
        return token.group() if token else None
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip escaped characters such as \{ and \}
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None
