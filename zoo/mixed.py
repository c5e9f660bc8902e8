"""The mixed workload: prompts whose answers change domain inside one generation.

Single-domain sets keep the best draft fixed for a whole answer; a runtime that switches
drafts can only show its worth when the text it must predict changes character midway.
Each pattern asks for one kind of text first and another after it ("explain this
clinical feature, then write a Python function for the dose"), on real material from
dev2 sources only (a dev2 HPO term, licence excerpt, speech passage, GSM template
instance or HumanEval task; dev2 is the old test split the set was drawn from). The
target is a 135M instruct model, so the instructions are explicit about the order of the
parts.

Rows: ``{"id", "domain": "mixed", "domains": [...in answer order], "prompt", "source":
[every contributing source], "split": "mixed"}``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from random import Random

from memspec.zoo.corpora import Doc, stable_hash
from memspec.zoo.prompttext import (
    MAX_PROMPT_CHARS,
    LeakGuard,
    documented_functions,
    excerpt,
    flat_text,
    leak_windows,
    prompt_body,
    round_robin,
)
from memspec.zoo.splits import DomainSplit

EXCERPT_CHARS = 260
MAX_MATERIAL_CHARS = {"code": 420, "math": 340, "medical": 300}


@dataclass(frozen=True)
class Material:
    """A piece of dev2 text a mixed prompt quotes."""

    domain: str
    source: str
    text: str
    name: str = ""  # HPO term name / Python function name


@dataclass(frozen=True)
class Pattern:
    """One way of crossing domains: the materials it quotes and the answer's domains."""

    name: str
    needs: tuple[str, ...]
    domains: tuple[str, ...]
    write: Callable[[Random, Mapping[str, Material]], str]


def _short(text: str, chars: int = 160) -> str:
    """A definition cut at a sentence, clause or word boundary, to quote it inline."""
    if len(text) <= chars:
        return text.rstrip(".")
    cut = text[:chars]
    for mark in (". ", "; ", ", "):
        end = cut.rfind(mark)
        if end > chars // 2:
            return cut[:end]
    return cut.rsplit(" ", 1)[0]


def _lower_first(name: str) -> str:
    return name[0].lower() + name[1:] if name[:2] != name[:2].upper() else name


# ------------------------------------------------------------------------------ patterns


def _medical_dose(r: Random, m: Mapping[str, Material]) -> str:
    med = m["medical"]
    w, mgkg, n = r.randint(12, 40), r.choice([10, 15, 20, 25, 30, 40]), r.choice([2, 3, 4])
    return (f"{med.name}. Definition: {med.text}\n\n"
            f"First explain in plain words what {_lower_first(med.name)} is and how it shows "
            f"in a patient. Then work out this dose step by step: a child weighing {w} kg is "
            f"prescribed {mgkg} mg/kg per day, split into {n} equal doses. How many milligrams "
            "is each dose?")


def _medical_dose_code(r: Random, m: Mapping[str, Material]) -> str:
    med = m["medical"]
    w, mgkg, n = r.randint(40, 95), r.choice([5, 8, 10, 12, 15]), r.choice([2, 3, 4])
    return (f"Clinical feature: {med.name}. {med.text}\n\n"
            "Explain this finding to a medical student in a short paragraph. Then write a "
            "Python function `dose_per_administration(weight_kg, mg_per_kg_per_day, "
            "doses_per_day)` that returns the dose in milligrams, and use it for a "
            f"{w} kg patient on {mgkg} mg/kg/day given in {n} doses.")


def _medical_infusion(r: Random, m: Mapping[str, Material]) -> str:
    med = m["medical"]
    vol, hours = r.choice([250, 500, 750, 1000, 1500]), r.choice([2, 4, 5, 6, 8, 12])
    return (f"A patient is admitted with {_lower_first(med.name)} ({_short(med.text)}).\n\n"
            "Describe what this feature means for the patient and how it is usually found. "
            "Then write a Python function that computes an infusion rate in mL per hour from "
            "a volume in mL and a duration in hours, and work out by hand the rate for "
            f"{vol} mL over {hours} hours.")


def _medical_records(r: Random, m: Mapping[str, Material]) -> str:
    med = m["medical"]
    return (f"Explain the clinical feature '{med.name}' ({_short(med.text)}) in two or three "
            "sentences. Then write a Python function that takes a list of patient records "
            "(dicts with an 'id' and a 'findings' list of strings) and returns the ids of the "
            f"patients whose findings mention '{med.name.lower()}', ignoring case.")


def _medical_bmi(r: Random, m: Mapping[str, Material]) -> str:
    med = m["medical"]
    kg, cm = r.randint(48, 120), r.randint(150, 195)
    return (f"{med.name}: {med.text}\n\n"
            "Summarise this feature for a patient leaflet in plain words. Then write a Python "
            "function `bmi(weight_kg, height_cm)` and compute, showing each step, the body "
            f"mass index of a patient who weighs {kg} kg and is {cm} cm tall.")


def _law_royalty(r: Random, m: Mapping[str, Material]) -> str:
    law = m["law"]
    n, price, pct = r.choice([120, 250, 400, 1500, 3000]), r.choice([19, 35, 49, 120]), \
        r.choice([2, 3, 5, 8])
    return (f"Licence excerpt:\n{law.text}\n\n"
            "Explain in plain language what this excerpt allows and what it requires. Then "
            f"work through an example with numbers: a company ships the software inside {n} "
            f"devices sold at ${price} each and sets aside {pct}% of that revenue for licence "
            "compliance. How much money is set aside?")


def _law_check(r: Random, m: Mapping[str, Material]) -> str:
    law = m["law"]
    return (f"{law.text}\n\n"
            "Summarise the obligations this licence text sets out. Then write a Python "
            "function `missing_obligations(distribution: dict) -> list[str]` that returns "
            "the obligations a software distribution fails to meet, where the dict has keys "
            "such as 'includes_licence_text', 'modified', 'source_available' and 'sold'.")


def _law_deadline(r: Random, m: Mapping[str, Material]) -> str:
    law = m["law"]
    cure, start, fix = r.choice([14, 30, 60]), r.randint(2, 20), r.randint(5, 50)
    return (f"Consider this licence clause:\n{law.text}\n\n"
            "What does it mean for someone using the software? After explaining it, answer "
            f"with a worked calculation: a user is told of a breach on day {start} and has "
            f"{cure} days to fix it; the fix takes {fix} days and starts the same day. Is the "
            "deadline met? Show the arithmetic.")


def _general_words(r: Random, m: Mapping[str, Material]) -> str:
    gen = m["general"]
    return (f"{gen.text}\n\n"
            "Write a short commentary on this passage for a general reader. Then write a "
            "Python function that counts how often each word occurs in a text, ignoring case "
            "and punctuation, and say which words you expect to be most frequent above.")


def _general_growth(r: Random, m: Mapping[str, Material]) -> str:
    gen = m["general"]
    x, rate, years = r.choice([40, 75, 120, 300, 850]), r.choice([2, 3, 4, 5, 6]), \
        r.choice([3, 4, 5, 10])
    return (f"Passage:\n{gen.text}\n\n"
            "Explain the main point of this passage in plain words. Then work through a "
            f"related calculation step by step: a programme costing ${x} million grows by "
            f"{rate}% every year. What does it cost after {years} years?")


def _general_interest(r: Random, m: Mapping[str, Material]) -> str:
    gen = m["general"]
    x, rate, years = r.choice([1000, 2500, 10000, 50000]), r.choice([3, 4, 5, 7]), \
        r.choice([5, 8, 10, 20])
    return (f"{gen.text}\n\n"
            "Summarise this passage in two sentences. Then write a Python function "
            "`compound(principal, rate_percent, years)` for compound interest and use it to "
            f"find what a loan of ${x} becomes at {rate}% a year after {years} years.")


def _code_essay(r: Random, m: Mapping[str, Material]) -> str:
    code = m["code"]
    return (f"```python\n{code.text}```\n\n"
            "Write a short essay for someone who does not program about the everyday problem "
            f"the function `{code.name}` solves and why it is useful, quoting its signature. "
            "Then give a complete implementation.")


def _code_by_hand(r: Random, m: Mapping[str, Material]) -> str:
    code = m["code"]
    return (f"```python\n{code.text}```\n\n"
            f"Complete the function `{code.name}`. Then work out by hand, step by step, what "
            "it returns for one of the examples in its docstring, and check that the "
            "arithmetic or counting is right.")


def _math_general_code(r: Random, m: Mapping[str, Material]) -> str:
    q = m["math"]
    return (f"{q.text}\n\n"
            "Solve this problem step by step. Then write a Python function that solves the "
            "general version of the problem, with each number as a parameter, and check it "
            "against your answer.")


def _math_everyday(r: Random, m: Mapping[str, Material]) -> str:
    q = m["math"]
    return (f"{q.text}\n\n"
            "First solve the problem, showing every step. Then write a short paragraph for a "
            "general reader about where this kind of calculation matters in everyday life.")


def _medical_licence(r: Random, m: Mapping[str, Material]) -> str:
    med, law = m["medical"], m["law"]
    return (f"A hospital team wrote a program that flags {_lower_first(med.name)} "
            f"({_short(med.text, 120)}) in clinical notes, and wants to publish it under a "
            f"licence with this clause:\n{law.text}\n\n"
            "First explain the clinical feature in plain words. Then explain what the clause "
            "would require of the team.")


PATTERNS: tuple[Pattern, ...] = (
    Pattern("medical-dose", ("medical",), ("medical", "math"), _medical_dose),
    Pattern("law-royalty", ("law",), ("law", "math"), _law_royalty),
    Pattern("general-words", ("general",), ("general", "code"), _general_words),
    Pattern("math-code", ("math",), ("math", "code"), _math_general_code),
    Pattern("code-essay", ("code",), ("general", "code"), _code_essay),
    Pattern("medical-dose-code", ("medical",), ("medical", "code"), _medical_dose_code),
    Pattern("law-check", ("law",), ("law", "code"), _law_check),
    Pattern("general-growth", ("general",), ("general", "math"), _general_growth),
    Pattern("medical-records", ("medical",), ("medical", "code"), _medical_records),
    Pattern("code-by-hand", ("code",), ("code", "math"), _code_by_hand),
    Pattern("law-deadline", ("law",), ("law", "math"), _law_deadline),
    Pattern("medical-infusion", ("medical",), ("medical", "code", "math"), _medical_infusion),
    Pattern("general-interest", ("general",), ("general", "code", "math"), _general_interest),
    Pattern("math-everyday", ("math",), ("math", "general"), _math_everyday),
    Pattern("medical-bmi", ("medical",), ("medical", "code", "math"), _medical_bmi),
    Pattern("medical-licence", ("medical", "law"), ("medical", "law"), _medical_licence),
)


# ------------------------------------------------------------------------------ material


def _function_name(stub: str) -> str | None:
    try:
        tree = ast.parse(stub)
    except SyntaxError:
        return None
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    return names[-1] if names else None


def _candidates(domain: str, doc: Doc, k: int) -> Material | None:
    """The k-th piece of material a dev2 document offers (None: nothing usable)."""
    limit = MAX_MATERIAL_CHARS.get(domain, EXCERPT_CHARS)
    meta = doc.get("meta", {})
    if domain in ("general", "law"):
        body = doc["text"].split("\n\n", 1)[-1] if domain == "law" else doc["text"]
        # k + 7: other passages than the dev2 prompts' (which start at k = 0)
        text = excerpt(body, ("mixed", doc["id"]), k + 7, chars=EXCERPT_CHARS)
        return Material(domain, doc["group"], text) if len(text) >= 120 else None
    if domain == "code" and doc["id"].startswith("stdlib:"):
        funcs = documented_functions(doc["text"])
        if k >= len(funcs):
            return None
        name, stub = funcs[k]
        return Material(domain, doc["group"], stub + "\n", name) if len(stub) < limit else None
    if k:  # one piece per document for the rest
        return None
    if domain == "medical":
        definition = meta.get("definition", "")
        if not 60 <= len(definition) <= limit:
            return None
        return Material(domain, doc["group"], definition, meta["name"])
    if domain == "code":
        stub = meta.get("prompt", "").strip("\n") + "\n"
        name = _function_name(stub)
        return Material(domain, doc["group"], stub, name) if name and len(stub) <= limit \
            else None
    question = meta.get("question", "")  # math
    return Material(domain, doc["group"], question) if 40 <= len(question) <= limit else None


def material_stream(domain: str, docs: Sequence[Doc], plan: DomainSplit,
                    accept: Callable[[str], bool]) -> Iterator[Material]:
    """dev2 material of one domain, spread over sources, each piece once."""
    pool = [d for d in docs if plan.doc_split.get(d["id"]) == "dev2"
            and (domain != "math" or d["id"].startswith("gsm:"))]
    seen: set[str] = set()
    for doc, k in round_robin(pool, f"mixed/{domain}"):
        mat = _candidates(domain, doc, k)
        if mat is None or mat.text in seen or not accept(mat.text):
            continue
        seen.add(mat.text)
        yield mat


def build_mixed(heldout: Mapping[str, Sequence[Doc]], plans: Mapping[str, DomainSplit],
                sets: Mapping[str, Sequence[dict]], guard: LeakGuard, n: int) -> list[dict]:
    """``n`` mixed prompts, patterns in turn; material never repeats another set's text."""
    windows = {w for rows in sets.values() for r in rows
               for w in leak_windows(prompt_body(r["prompt"]))}

    def fresh(text: str) -> bool:
        flat = flat_text(text)
        return guard.clean(flat) and not any(w in flat for w in windows)

    streams = {d: material_stream(d, heldout[d], plans[d], fresh)
               for d in {d for p in PATTERNS for d in p.needs}}
    rows: list[dict] = []
    misses = 0
    while len(rows) < n:
        pattern = PATTERNS[(len(rows) + misses) % len(PATTERNS)]
        try:
            mats = {d: next(streams[d]) for d in pattern.needs}
        except StopIteration as exc:
            raise RuntimeError(f"mixed: ran out of dev2 material for {pattern.name}") from exc
        prompt = pattern.write(Random(stable_hash("mixed", len(rows), pattern.name)), mats)
        if len(prompt) > MAX_PROMPT_CHARS or not fresh(flat_text(prompt)):
            misses += 1  # too long, or quoting another set as framed: next pattern's turn
            if misses > 10 * n:
                raise RuntimeError("mixed: material keeps failing the length or leak checks")
            continue
        rows.append({"id": f"mixed-{len(rows):03d}", "domain": "mixed",
                     "domains": list(pattern.domains), "prompt": prompt,
                     "source": [mats[d].source for d in pattern.needs], "split": "mixed",
                     "pattern": pattern.name})
    return rows
