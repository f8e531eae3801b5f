"""Varied training conversations for drafter distillation, beyond the built-in template set.

Sources (each a generator of conversations in the neutral {"role", "content"} form; the target writes
every reply itself): the built-in templates, math word problems with fresh numbers, code tasks across
languages and phrasings, tool-use transcripts (tools in the system prompt, a call and its result as turns),
long agent-like system prompts, self-instruct seeds (the target writes a user request, which is then
answered as a prompt of its own) and multi-turn follow-ups (a reply, then one more user turn).

Every source passes `exclude_heldout`, so the held-out evaluation prompts (`data/train_heldout.jsonl`)
never reach training, not even as part of a longer message.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

Messages = list[dict[str, str]]

_WORD = re.compile(r"[a-z0-9]+")
NGRAM = 8  # a conversation sharing this many consecutive words with a held-out prompt is dropped


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class HeldoutFilter:
    """Rejects text that contains a held-out prompt or shares a `NGRAM`-word run with one."""

    def __init__(self, heldout: Iterable[str]) -> None:
        self.grams: set[tuple[str, ...]] = set()
        self.whole: list[str] = []
        for text in heldout:
            w = _words(text)
            self.whole.append(" ".join(w))
            self.grams.update(tuple(w[i : i + NGRAM]) for i in range(max(1, len(w) - NGRAM + 1)))

    def clean(self, text: str) -> bool:
        w = _words(text)
        joined = " ".join(w)
        if any(h and h in joined for h in self.whole):
            return False
        return not any(tuple(w[i : i + NGRAM]) in self.grams for i in range(max(1, len(w) - NGRAM + 1)))

    def clean_conversation(self, conv: Messages) -> bool:
        return all(self.clean(m["content"]) for m in conv)


def exclude_heldout(convs: Iterable[Messages], keep: HeldoutFilter) -> Iterator[Messages]:
    return (c for c in convs if keep.clean_conversation(c))


# math -----------------------------------------------------------------------------------------------------

_NAMES = ["Maya", "Liam", "Sofia", "Omar", "Chen", "Priya", "Lucas", "Amara", "Jonas", "Elena", "Kofi", "Yuki"]
_ITEMS = ["notebooks", "apples", "tickets", "bottles of water", "pencils", "cupcakes", "plants", "books"]
_UNITS = [
    ("kilometres", "metres", 1000),
    ("hours", "seconds", 3600),
    ("kilograms", "grams", 1000),
    ("days", "hours", 24),
    ("litres", "millilitres", 1000),
    ("feet", "inches", 12),
]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(2, 12)
    name, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
    big, small, _factor = rng.choice(_UNITS)
    price = rng.choice([0.5, 1.25, 2, 2.5, 4, 7.5, 12])
    style = rng.choice(
        ["", " Show your work.", " Explain each step.", " Give just the answer and one line of reasoning."]
    )
    forms = [
        f"{name} buys {a} {item} at {price} dollars each. How much does {name} pay?",
        f"What is {b}% of {a * 10}?",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"A train travels {a * 5} km in {c} hours. What is its average speed?",
        f"Find the area of a triangle with base {a} cm and height {b} cm.",
        f"{name} has {a + b} {item} and gives {b} to {other}. Then {other} gives back half of them. "
        f"How many does {name} have now?",
        f"What is the average of {a}, {b}, {c} and {a + c}?",
        f"Convert {c} {big} into {small}.",
        f"Simplify the fraction {a * c}/{b * c}.",
        f"If {c} workers build a wall in {a} days, how long would {c * 2} workers take at the same rate?",
        f"A box holds {c} rows of {b} {item}. How many {item} are in {a} boxes?",
        f"What is the least common multiple of {c} and {b}?",
        f"{name} saves {b} dollars a week. How many weeks until {name} has {b * a} dollars?",
        f"Is {a * 7 + 1} a prime number? Explain.",
        f"A rectangle has a perimeter of {2 * (a + b)} m and a length of {a} m. What is its width?",
        f"Calculate {a} × {b} − {c * 3}.",
        f"What is the probability of rolling a number greater than {c % 5 + 1} on a fair six-sided die?",
        f"An item costs {a * 4} dollars and is discounted by {b % 50 + 5}%. What is the new price?",
        f"Write the first {c + 3} terms of the sequence that starts at {b} and adds {c} each time.",
        f"{name} is {c} years older than {other}. Together they are {2 * a + c} years old. How old is each?",
    ]
    return rng.choice(forms) + style


# code -----------------------------------------------------------------------------------------------------

_LANGS = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Bash", "SQL", "Ruby", "Kotlin"]
_TASKS = [
    "reverses a string",
    "counts the vowels in a sentence",
    "finds the maximum of a list",
    "checks if a number is even",
    "merges two sorted lists",
    "removes duplicates from a list",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome",
    "flattens a nested list",
    "converts Celsius to Fahrenheit",
    "counts word frequencies in a text",
    "finds the longest word in a sentence",
    "validates an email address with a simple rule",
    "sorts a list of dictionaries by a key",
    "reads a CSV file and sums a column",
    "implements binary search",
    "computes the greatest common divisor",
    "groups items by their first letter",
    "parses a date string",
    "generates a random password",
    "capitalizes every word",
    "rotates a list by k positions",
    "checks for balanced parentheses",
    "implements a simple stack",
    "chunks a list into pieces of size k",
    "computes a running average",
    "finds all primes below n",
    "transposes a matrix",
    "counts lines in a file",
]
_CODE_FORMS = [
    "Write a {lang} function that {task}.",
    "How would you write code in {lang} that {task}? Keep it short.",
    "Show me a {lang} snippet that {task}, with a brief explanation.",
    "I need a {lang} program that {task}. Add comments.",
    "Can you write a {lang} function that {task} and a small test for it?",
    "Explain, step by step, how to write a {lang} function that {task}.",
]
_CONSTRAINTS = [
    "",
    "",
    " Use clear variable names.",
    " Handle empty input.",
    " Do not use any libraries.",
    " Include type hints or types where the language has them.",
    " Keep it under 15 lines.",
    " Use recursion if it fits.",
    " Explain the time complexity.",
    " Show an example call and its output.",
]
_SNIPPETS = [
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "for i in range(5):\n    if i % 2 == 0:\n        print(i)",
    "const xs = [1, 2, 3];\nconst ys = xs.map(x => x * 2);\nconsole.log(ys);",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 2;",
    "int total = 0;\nfor (int i = 0; i < n; i++) {\n    total += a[i];\n}",
    "words = text.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
    'fn main() {\n    let v: Vec<i32> = (1..=10).filter(|x| x % 3 == 0).collect();\n    println!("{:?}", v);\n}',
    'while read -r line; do\n  echo "${line^^}"\ndone < input.txt',
]


def _code(rng: random.Random) -> str:
    if rng.random() < 0.2:
        snippet = rng.choice(_SNIPPETS)
        ask = rng.choice(
            [
                "What does this code do?",
                "Is there a bug in this code?",
                "How can I make this faster?",
                "Rewrite this in a more readable way.",
                "Add error handling to this code.",
            ]
        )
        return f"{ask}\n\n```\n{snippet}\n```"
    ask = rng.choice(_CODE_FORMS).format(lang=rng.choice(_LANGS), task=rng.choice(_TASKS))
    return ask + rng.choice(_CONSTRAINTS)


# tools and agents -----------------------------------------------------------------------------------------

_TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "name": "search_web",
        "description": "Search the web and return the top results",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
    {
        "name": "read_file",
        "description": "Read a text file from the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "run_shell",
        "description": "Run a shell command and return its output",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
    {
        "name": "convert_currency",
        "description": "Convert an amount between currencies",
        "parameters": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
            "required": ["amount", "from", "to"],
        },
    },
]
_CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Sydney"]


def _tool_conversation(rng: random.Random) -> Messages:
    tools = rng.sample(_TOOLS, k=rng.randint(2, len(_TOOLS)))
    system = (
        "You are a helpful assistant with access to these tools:\n"
        + "\n".join(json.dumps(t) for t in tools)
        + '\nTo call a tool, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>. '
        "After a tool result arrives, answer the user in plain language."
    )
    tool = rng.choice(tools)
    city = rng.choice(_CITIES)
    asks = {
        "get_weather": (
            f"What's the weather like in {city} right now?",
            {"city": city},
            {"city": city, "temp_c": rng.randint(-5, 35), "sky": rng.choice(["clear", "rain", "cloudy"])},
        ),
        "search_web": (
            f"Find me recent news about {rng.choice(['solar power', 'chess', 'space probes'])}.",
            {"query": "recent news"},
            {"results": ["Article one", "Article two"]},
        ),
        "read_file": (
            "Summarize the file notes/todo.txt for me.",
            {"path": "notes/todo.txt"},
            {"content": "buy milk\nfix the login bug\ncall the bank"},
        ),
        "run_shell": (
            "How many Python files are in this project?",
            {"command": "ls **/*.py | wc -l"},
            {"stdout": str(rng.randint(3, 300))},
        ),
        "convert_currency": (
            f"Convert {rng.randint(5, 900)} euros to dollars.",
            {"amount": 100, "from": "EUR", "to": "USD"},
            {"result": round(rng.uniform(50, 1000), 2)},
        ),
    }
    user, args, result = asks[str(tool["name"])]
    conv: Messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if rng.random() < 0.6:
        call = json.dumps({"name": tool["name"], "arguments": args})
        conv.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
        conv.append({"role": "tool", "content": json.dumps(result)})
    return conv


_AGENT_RULES = [
    "Always think about the user's goal before acting.",
    "Prefer small, reversible changes.",
    "Never reveal secrets such as API keys or passwords.",
    "When unsure, ask one clarifying question.",
    "Keep answers concise and use Markdown for code.",
    "Cite the files you changed.",
    "Run the tests after every change and report failures honestly.",
    "Do not invent facts.",
    "Explain trade-offs when there is more than one good option.",
    "Respect the existing code style.",
    "Summarize what you did at the end of each task.",
    "Work step by step and check each result.",
]
_AGENT_TASKS = [
    "Add input validation to the signup form.",
    "Why is my build failing with 'module not found'?",
    "Refactor the payment module so it is easier to test.",
    "Write a README section about configuration.",
    "Plan a migration from a monolith to two services.",
    "Review this function for security problems.",
    "Set up a daily backup of the database.",
    "Draft a short status update for the team.",
]


def _agent_conversation(rng: random.Random) -> Messages:
    rules = rng.sample(_AGENT_RULES, k=rng.randint(6, len(_AGENT_RULES)))
    system = (
        f"You are {rng.choice(['Atlas', 'Nova', 'Helper', 'CodeMate'])}, an autonomous assistant working in a "
        f"software team. Today is day {rng.randint(1, 300)} of the project.\n\n# Rules\n"
        + "\n".join(f"{i + 1}. {r}" for i, r in enumerate(rules))
        + "\n\n# Environment\nYou can read files, run commands and edit code. The repository uses "
        + rng.choice(["Python 3.12 and pytest", "TypeScript and Jest", "Go modules", "Rust with cargo"])
        + ".\n"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(_AGENT_TASKS)}]


# self-instruct and follow-ups -----------------------------------------------------------------------------

_SEED_TOPICS = [
    "cooking",
    "travel",
    "personal finance",
    "history",
    "physics",
    "biology",
    "programming",
    "writing",
    "fitness",
    "music",
    "gardening",
    "careers",
    "language learning",
    "astronomy",
    "geography",
    "pets",
    "mathematics",
    "productivity",
    "art",
    "economics",
    "psychology",
    "cars",
    "weather",
    "movies",
]
_SEED_FORMS = [
    "Write one question that a curious person might ask about {topic}. Reply with the question only.",
    "Write a short request that someone could send to an AI assistant about {topic}. Only the request.",
    "Invent a realistic task involving {topic} that a user might ask a chatbot to do. Write just the task.",
    "Write one {kind} question about {topic}. Output only the question.",
]
FOLLOW_UPS = [
    "Can you explain that in more detail?",
    "Can you give me an example?",
    "Make it shorter, please.",
    "Thanks! What should I do next?",
    "Can you put that into a bulleted list?",
    "Why is that?",
    "Could you rewrite it for a beginner?",
    "What are the most common mistakes here?",
    "Now do the same in JavaScript.",
    "Can you check your answer step by step?",
    "Continue.",
    "Summarize your answer in one sentence.",
    "What would change if the numbers were doubled?",
    "Add comments to the code.",
    "Is there a faster way?",
    "Give me three alternatives.",
]


def self_instruct_seeds(rng: random.Random, count: int) -> list[Messages]:
    """Prompts asking the target to write a user request (its reply then becomes a prompt of its own)."""
    out = []
    for _ in range(count):
        form = rng.choice(_SEED_FORMS)
        text = form.format(topic=rng.choice(_SEED_TOPICS), kind=rng.choice(["simple", "tricky", "practical"]))
        out.append([{"role": "user", "content": text}])
    return out


def follow_up(conv: Messages, reply: str, rng: random.Random) -> Messages:
    """The conversation continued: the target's reply, then one more user turn."""
    return [*conv, {"role": "assistant", "content": reply}, {"role": "user", "content": rng.choice(FOLLOW_UPS)}]


SOURCES: dict[str, Callable[[random.Random], Messages]] = {
    "math": lambda rng: [{"role": "user", "content": _math(rng)}],
    "code": lambda rng: [{"role": "user", "content": _code(rng)}],
    "tools": _tool_conversation,
    "agent": _agent_conversation,
}


def mixed_conversations(
    count: int,
    seed: int,
    heldout: Sequence[str],
    *,
    builtin: Sequence[Messages] = (),
    shares: dict[str, float] | None = None,
) -> list[tuple[str, Messages]]:
    """`count` distinct (source, conversation) pairs: the built-in templates first (as given), then the
    generated sources in the given shares; none touches a held-out prompt."""
    rng = random.Random(seed)
    keep = HeldoutFilter(heldout)
    shares = shares or {"math": 0.35, "code": 0.35, "tools": 0.15, "agent": 0.15}
    out: list[tuple[str, Messages]] = []
    seen: set[str] = set()

    def add(source: str, conv: Messages) -> None:
        key = json.dumps(conv)
        if key not in seen and keep.clean_conversation(conv):
            seen.add(key)
            out.append((source, conv))

    for conv in builtin:
        if len(out) >= count:
            break
        add("builtin", conv)
    names, weights = list(shares), [shares[n] for n in shares]
    misses = 0
    while len(out) < count and misses < 50 * count:
        before = len(out)
        name = rng.choices(names, weights)[0]
        add(name, SOURCES[name](rng))
        misses += len(out) == before
    return out
