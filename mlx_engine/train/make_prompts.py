"""Write the training and held-out instruction prompts (programmatic, written here; no external data).

    python -m mlx_engine.train.make_prompts    # -> mlx_engine/train/data/prompts_train.jsonl, prompts_eval.jsonl, prompts_train2.jsonl

Templates x topics, shuffled with a fixed seed. The held-out set uses its own templates AND its own
topics, so no held-out prompt shares a topic or a phrasing with a training prompt.
"""

import json
import random
from pathlib import Path

DATA = Path(__file__).parent / "data"  # prompts and corpora, shipped as package data

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "earthquakes", "the immune system",
    "vaccines", "climate change", "renewable energy", "solar panels", "wind turbines", "electric cars",
    "the internet", "email", "cloud computing", "machine learning", "neural networks", "databases",
    "compilers", "operating systems", "encryption", "passwords", "blockchain", "the stock market",
    "inflation", "interest rates", "budgeting", "saving money", "credit cards", "taxes",
    "the Roman Empire", "ancient Egypt", "the printing press", "the industrial revolution", "the moon landing",
    "democracy", "the United Nations", "world trade", "supply and demand", "small businesses",
    "healthy eating", "sleep", "exercise", "meditation", "stress", "drinking water", "vitamins",
    "gardening", "composting", "houseplants", "bees", "birds", "dogs", "cats", "whales", "forests",
    "oceans", "deserts", "rainforests", "mountains", "rivers", "weather forecasts", "hurricanes",
    "cooking pasta", "baking bread", "coffee", "tea", "chocolate", "spices", "fermentation",
    "learning a language", "public speaking", "job interviews", "writing a resume", "teamwork",
    "time management", "note taking", "studying for exams", "reading books", "libraries", "museums",
    "music theory", "playing the guitar", "painting", "photography", "film making", "poetry",
    "chess", "soccer", "running a marathon", "swimming", "cycling", "yoga", "camping", "traveling abroad",
    "trains", "airplanes", "bridges", "skyscrapers", "robots", "3D printing", "smartphones", "batteries",
    "magnets", "electricity", "light", "sound", "gravity", "atoms", "DNA", "evolution", "dinosaurs",
    "the solar system", "Mars", "stars", "telescopes", "recycling", "plastic pollution", "clean air",
]

CODE_TOPICS = [
    "reverse a string", "check if a number is prime", "compute the factorial of n", "read a text file line by line",
    "count word frequencies in a text", "sort a list of dictionaries by a key", "remove duplicates from a list",
    "find the largest element in a list", "merge two sorted lists", "compute Fibonacci numbers",
    "parse a JSON string", "write a CSV file", "validate an email address", "convert Celsius to Fahrenheit",
    "flatten a nested list", "check if a string is a palindrome", "compute the average of a list",
    "implement binary search", "implement a stack", "implement a queue", "count vowels in a string",
    "generate a random password", "compute the greatest common divisor", "transpose a matrix",
    "find common elements of two lists", "download a web page", "measure how long a function takes",
    "rename files in a folder", "group items by a key", "implement bubble sort",
]

LANGS = ["Python", "JavaScript", "Python", "C", "Python", "Rust", "Go", "Python", "Java", "Bash"]

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Give a short explanation.",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t} for a ten-year-old.",
    "List five key points about {t}.",
    "Why is {t} important?",
    "Write a short story that involves {t}.",
    "What are the pros and cons of {t}?",
    "How would you teach someone about {t}?",
    "Summarize the history of {t} in a few sentences.",
    "Write a haiku about {t}.",
    "What are common misconceptions about {t}?",
    "Give me some tips related to {t}.",
    "Describe {t} as if you were a tour guide.",
]

CODE_TEMPLATES = [
    "Write a {lang} function to {c}.",
    "How do I {c} in {lang}?",
    "Show me {lang} code to {c}, and explain it briefly.",
]

HOWTOS = [
    "make a cup of tea", "plant a tree", "change a flat tire", "write a thank-you note", "start a vegetable garden",
    "organize a closet", "prepare for a job interview", "train a puppy", "learn to swim", "make pancakes",
    "set up a home network", "clean a laptop keyboard", "pack for a weekend trip", "write a cover letter",
    "plan a birthday party", "start running", "make a budget", "fix a leaking tap", "take better photos",
    "improve your handwriting",
]

# held-out: different topics and different phrasings
EVAL_TOPICS = [
    "glaciers", "coral reefs", "the Silk Road", "submarines", "lighthouses", "honey", "origami", "tides",
    "rainbows", "the Olympic Games", "windmills", "caves", "penguins", "the metric system", "calendars",
]
EVAL_TEMPLATES = [
    "Tell me about {t}.",
    "Can you describe how {t} work or what they are, briefly?",
    "I am curious about {t}. What should I know?",
]
EVAL_CODE = [
    "Write a Python function that returns the second largest number in a list.",
    "In Python, how can I count the lines in a file?",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "How do I check whether a key exists in a Python dictionary?",
    "Write a JavaScript function that capitalizes every word in a sentence.",
]


def train_prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for t in TOPICS:
        for tpl in rng.sample(TEMPLATES, 3):
            out.append(tpl.format(t=t))
    for c in CODE_TOPICS:
        for tpl in rng.sample(CODE_TEMPLATES, 2):
            out.append(tpl.format(c=c, lang=rng.choice(LANGS)))
    for h in HOWTOS:
        out.append(f"How do I {h}? Give step-by-step instructions.")
        out.append(f"What is the easiest way to {h}?")
    rng.shuffle(out)
    return out


def extra_prompts(used: set[str], seed: int = 2) -> list[str]:
    """Every other template x topic combination (the second corpus): same topics and phrasings as
    train_prompts, disjoint from the held-out set by construction."""
    out = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    out += [tpl.format(c=c, lang=lang) for c in CODE_TOPICS for tpl in CODE_TEMPLATES for lang in sorted(set(LANGS))]
    out += [f"Explain how to {h}, briefly." for h in HOWTOS] + [f"What mistakes do people make when they {h}?" for h in HOWTOS]
    out = sorted(set(out) - used)
    random.Random(seed).shuffle(out)
    return out


def eval_prompts(seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    out = [rng.choice(EVAL_TEMPLATES).format(t=t) for t in EVAL_TOPICS] + EVAL_CODE
    rng.shuffle(out)
    return out


def main() -> None:
    train, ev = train_prompts(), eval_prompts()
    extra = extra_prompts(set(train))
    assert not set(train) & set(ev) and not set(extra) & set(ev)
    for name, rows in (("prompts_train.jsonl", train), ("prompts_eval.jsonl", ev), ("prompts_train2.jsonl", extra)):
        with open(DATA / name, "w") as f:
            for p in rows:
                f.write(json.dumps({"prompt": p}) + "\n")
        print(f"{name}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
