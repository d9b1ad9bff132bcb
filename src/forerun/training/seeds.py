"""Seed prompts for self-distillation, written for this project (no benchmark text).

The target answers these prompts and the drafter learns from its answers, so what matters
is breadth of task and style: explanations, stories, letters, role play, code, lists,
translation, summaries and question answering. Passages for the summary, extraction and
translation tasks come from the training corpus (e.g. GSM8K questions), never from a
benchmark.
"""

from __future__ import annotations

import random

TOPICS = [
    "volcanoes", "the water cycle", "public libraries", "electric cars", "honey bees", "the printing press",
    "sourdough bread", "solar panels", "chess openings", "the human heart", "coral reefs", "jazz music",
    "the Roman roads", "vaccines", "city parks", "smartphones", "the moon landing", "recycling plastic",
    "desert plants", "the stock market", "ancient Egypt", "photosynthesis", "marathon training", "glaciers",
    "the internet", "board games", "tea ceremonies", "earthquakes", "rainforests", "black holes",
    "learning a new language", "remote work", "the Olympic games", "bicycles", "migrating birds",
    "cloud computing", "the French Revolution", "octopuses", "wind turbines", "a small coffee shop",
    "space telescopes", "ancient Greek theatre", "urban gardening", "the immune system", "renewable energy policy",
    "the history of money", "artificial intelligence", "mountain climbing", "the Silk Road", "climate change",
    "public transport", "the Renaissance", "sleep and memory", "video game design", "wildfires", "the printing of books",
    "electric guitars", "hydropower dams", "the Great Wall of China", "volunteering", "minimalism", "the periodic table",
    "social media", "a job interview", "saving money", "the water footprint of food", "bees and pollination",
    "quantum computers", "the Industrial Revolution", "a family holiday", "learning to cook", "the history of jazz",
    "ocean tides", "starting a small business", "the human brain",
]

TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short essay about {t}.",
    "Give five interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short story in which {t} plays an important role.",
    "Write a poem about {t}.",
    "Describe the history of {t} in a few paragraphs.",
    "Write an email to a friend recommending a book about {t}.",
    "Imagine you are a tour guide. Introduce visitors to {t}.",
    "You are a teacher. Prepare a short lesson plan about {t}.",
    "Pretend you are a famous scientist and answer: why should people care about {t}?",
    "List three common misconceptions about {t} and correct them.",
    "Compare {t} with {u}. What do they have in common?",
    "Write a persuasive paragraph arguing that more people should learn about {t}.",
    "Write a dialogue between two friends discussing {t}.",
    "Summarize what an encyclopedia article about {t} would say.",
    "What questions would a journalist ask an expert on {t}? Answer them too.",
    "Write a product description for something related to {t}.",
    "Write a blog post titled 'What I learned about {t}'.",
    "Answer briefly: what is the most important thing to know about {t}?",
]

CODE_TASKS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th prime number, with a docstring and an example.",
    "Write a JavaScript function that removes duplicate values from an array.",
    "Write a SQL query that finds the ten customers with the highest total order value.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a bash script that counts the lines of every .txt file in a folder.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Implement binary search in C and explain how it works.",
    "Write a Python program that reads a CSV file and prints the average of one column.",
    "Explain what recursion is and give a Python example that computes a factorial.",
    "Write a function in Python that counts how often each word appears in a text.",
    "Write a Python function to check if two strings are anagrams of each other.",
    "Explain big-O notation with three short examples.",
    "Write a Python generator that yields the Fibonacci numbers.",
    "Write a regular expression that matches e-mail addresses and explain each part.",
]

PASSAGE_TEMPLATES = [
    "Summarize: {p}",
    "Summarize the following text in one sentence: {p}",
    "Translate English to German: {p}",
    "Translate English to French: {p}",
    "Translate English to Spanish: {p}",
    "Extract every number in the following text and say what it refers to: {p}",
    "Read the passage and answer: what is being asked? Passage: {p}",
    "Rewrite the following text in a formal tone: {p}",
    "List the people and objects mentioned in this text: {p}",
    "{p} Solve this step by step.",
    "{p}",
]


QUESTIONS = [
    "Who invented the telephone?", "What is the capital of Australia?", "How many bones are in the human body?",
    "When did the first person walk on the moon?", "What is the largest ocean on Earth?", "Who wrote Pride and Prejudice?",
    "What does DNA stand for?", "Which planet is closest to the sun?", "What is the boiling point of water in Fahrenheit?",
    "Who painted the ceiling of the Sistine Chapel?", "What language is spoken in Brazil?", "How long is a marathon?",
    "What is the speed of light?", "Which country has the largest population?", "What is the chemical symbol for gold?",
    "Who was the first president of the United States?", "What causes the seasons on Earth?", "How does a vaccine work?",
    "What is inflation?", "Why is the sky blue?", "What is the tallest mountain in the world?", "Who discovered penicillin?",
]

# Tasks whose material the target writes first (stage 1), then works on (stage 2): German text to
# translate, articles to summarise, passages to answer questions from.
PASSAGE_WRITERS = [
    ("Write a short paragraph in German about {t}.", "Translate German to English: {p}"),
    ("Write a short news article about {t}.", "Summarize: {p}"),
    ("Write a short encyclopedia paragraph about {t}.", "{p}\nBased on the passage above, what is the main point about {t}?"),
    ("Write two short customer reviews of a product related to {t}.", "Rate each review from 1 to 5 and explain: {p}"),
]


def passage_writer_prompts(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(stage-1 prompt, stage-2 template, topic): the stage-2 prompt embeds the target's stage-1 answer."""
    rng = random.Random(seed + 1)
    return [(w.format(t=t), follow, t) for w, follow in [rng.choice(PASSAGE_WRITERS) for _ in range(n)]
            for t in [rng.choice(TOPICS)]]


def builtin_prompts(passages: list[str], n: int, seed: int = 0) -> list[str]:
    """``n`` varied prompts: topic templates, coding tasks, and tasks over ``passages``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0 or kind == 1:
            t, u = rng.sample(TOPICS, 2)
            out.append(rng.choice(TEMPLATES).format(t=t, u=u))
        elif kind == 2 and i % 8 == 2:
            out.append(rng.choice(CODE_TASKS))
        elif kind == 2:
            out.append(rng.choice(QUESTIONS))
        elif passages:
            out.append(rng.choice(PASSAGE_TEMPLATES).format(p=rng.choice(passages)))
        else:
            out.append(rng.choice(TEMPLATES).format(t=rng.choice(TOPICS), u=rng.choice(TOPICS)))
    return out
