"""Seed prompts for self-distillation, written for this project (no benchmark text).

The target answers these prompts and the drafter learns from its answers, so what matters is
breadth of task and style. The prompts are spread evenly over task families that cover what
users ask a model (and what Spec-Bench measures): writing, role play, reasoning puzzles, math,
code, science, humanities, short factual questions, and — in two stages, over material the
target writes itself — translation from German, summaries of articles, answers from retrieved
passages and extraction from reviews. Topics, personas and templates are combined at random
(fixed seed), so a few hundred lines give thousands of distinct prompts.
"""

from __future__ import annotations

import random
import re

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
    "public transport", "the Renaissance", "sleep and memory", "video game design", "wildfires",
    "electric guitars", "hydropower dams", "the Great Wall of China", "volunteering", "minimalism",
    "the periodic table", "social media", "a job interview", "saving money", "the water footprint of food",
    "quantum computers", "the Industrial Revolution", "a family holiday", "learning to cook", "ocean tides",
    "starting a small business", "the human brain", "a local election", "a new hospital", "a football final",
    "a rise in housing prices", "a storm on the coast", "a film festival", "a museum opening", "a train strike",
    "a new vaccine trial", "a school reform", "a bank merger", "a rescued dog", "a charity marathon",
    "a factory closing", "a rocket launch", "a drought", "a royal wedding", "a court ruling", "a tech company",
    "pawn shops", "the European Union", "a bridge collapse", "a lottery winner", "tourism in Hawaii",
    "the Amazon river", "medieval castles", "the Beatles", "Shakespeare's plays", "the Cold War",
    "the theory of evolution", "nuclear power", "the Mars rover", "Mount Everest", "the Titanic",
    "organic farming", "fast fashion", "cryptocurrency", "the Nile", "penguins", "the Mona Lisa",
]

WRITING_FORMS = [
    "an engaging travel blog post about {t}", "a professional email to your manager about {t}",
    "a short story about {t}", "a poem about {t}", "a persuasive essay about {t}", "a speech for a school event about {t}",
    "a cover letter for a job related to {t}", "a product review of something related to {t}",
    "a press release announcing {t}", "a short film script about {t}", "a limerick about {t}",
    "a letter to a friend about {t}", "a newsletter introduction about {t}", "a social media post about {t}",
    "a catchy headline and opening paragraph about {t}", "a diary entry about {t}", "a fable about {t}",
    "an advertisement for {t}", "a restaurant review that mentions {t}", "a motivational message about {t}",
]

WRITING_TEMPLATES = [
    "Write {f}.", "Compose {f}.", "Draft {f}.", "Please write {f}. Keep it short.",
    "Write {f}, highlighting three key points.", "Compose {f} for a general audience.",
    "Write {f}. Use a friendly tone.", "Draft {f} in under 200 words.",
]

PERSONAS = [
    "a pirate captain", "Sherlock Holmes", "a medieval knight", "a famous chef", "a space station astronaut",
    "a kindergarten teacher", "a travel agent", "a stand-up comedian", "a detective", "a wise old wizard",
    "a sports commentator", "a doctor", "a personal trainer", "a startup founder", "a museum guide",
    "a poet", "a math tutor", "a customer service agent", "a historian", "a lawyer", "a gardener",
    "a robot from the future", "an environmental activist", "a financial advisor", "a movie critic",
]

ROLE_TEMPLATES = [
    "Pretend you are {r}. {q}", "Act as {r}. {q}", "Imagine you are {r}. {q}",
    "You are {r}. Stay in character and answer: {q}", "Take on the role of {r} in this conversation. {q}",
    "I want you to act as {r}. My first question is: {q}", "Embrace the role of {r}. {q}",
]

ROLE_QUESTIONS = [
    "What do you think about {t}?", "Describe a typical day in your life.", "Give me your best advice on {t}.",
    "Why should people care about {t}?", "Tell me a story from your past.", "How would you explain {t} to me?",
    "What is your biggest fear?", "What would you change about the world?", "Convince me to try {t}.",
    "What was your greatest achievement?", "How do you deal with stress?", "What do you eat for breakfast?",
]

NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Frank", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo",
         "Maria", "Nora", "Omar", "Paul", "Rosa", "Sam", "Tom", "Uma", "Victor", "Wendy", "Yusuf", "Zoe"]
THINGS = ["apples", "books", "marbles", "stickers", "coins", "pencils", "cookies", "tickets", "shells", "cards"]


def _reasoning(rng: random.Random) -> str:
    a, b, c, d = rng.sample(NAMES, 4)
    n, m = rng.randint(2, 9), rng.randint(10, 40)
    return rng.choice([
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
        f"In a race, you overtake the person in position {n}. What position are you in now?",
        f"{a} has {m} {rng.choice(THINGS)} and gives half to {b}, who gives {n} to {c}. How many does {b} have left?",
        f"If all {rng.choice(THINGS)} are red and some red things are heavy, are some {rng.choice(THINGS)} heavy? "
        "Explain.",
        f"{a}, {b} and {c} sit in a row. {a} is not at either end and {b} is to the left of {a}. Where does {c} sit?",
        f"{a} is the mother of {b}, and {b} is the father of {c}. What is the relationship between {a} and {c}?",
        f"A farmer has {m} sheep and all but {n} run away. How many are left?",
        "Which is heavier: a kilogram of feathers or a kilogram of iron? Explain.",
        f"If it takes {n} machines {n} minutes to make {n} widgets, how long would {m} machines take to make "
        f"{m} widgets?",
        f"{a} is older than {b} but younger than {c}. {d} is older than {c}. List them from oldest to youngest.",
        f"One of {a}, {b} and {c} broke a vase. {a} says '{b} did it'. {b} says 'I did not'. {c} says 'I did not'. "
        "Only one of them tells the truth. Who broke the vase?",
        f"A clock shows {n}:15. What is the angle between the hour and the minute hands?",
    ])


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 20), rng.randint(2, 50), rng.randint(1, 99)
    x1, y1, x2, y2, x3, y3 = (rng.randint(-5, 9) for _ in range(6))
    return rng.choice([
        f"Solve for x: {a}x + {b} = {a * c + b}.",
        f"What is {a}% of {b * 20}?",
        f"The vertices of a triangle are at ({x1}, {y1}), ({x2}, {y2}) and ({x3}, {y3}). What is its area?",
        f"Find the sum of the first {a + 5} positive integers.",
        f"A rectangle has a length of {b} cm and a width of {a} cm. What are its area and perimeter?",
        f"What is the probability of rolling a sum of {rng.randint(3, 11)} with two fair dice?",
        f"Simplify the expression ({a}x + {b}) - ({c}x - {a}).",
        f"A company invests ${b * 1000} in the first year and half of that in the second year. "
        "What is the total investment?",
        f"If f(x) = {a}x^2 - {b}x + {c}, what is f({rng.randint(1, 6)})?",
        f"What is the remainder when {b * c + a} is divided by {a + 1}?",
        f"Find the greatest common divisor of {a * 6} and {a * 9}.",
        f"Solve the system: x + y = {a + b}, x - y = {b - a}.",
        f"How many prime numbers are there between {c} and {c + 30}?",
        f"A car travels {b * 3} km in {rng.randint(2, 5)} hours. What is its average speed?",
    ])


LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "C", "Go", "Rust", "SQL", "bash"]
CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number", "sorts a list with merge sort",
    "finds the longest common subsequence of two strings", "reverses a linked list", "counts word frequencies in a text",
    "checks whether a number is prime", "finds the median of two sorted arrays", "implements binary search",
    "removes duplicates from an array", "computes the factorial of a number recursively",
    "validates an e-mail address with a regular expression", "reads a CSV file and prints the average of a column",
    "finds the top 5 most frequent words in all text files of a directory", "implements a stack with push and pop",
    "converts a decimal number to binary", "merges two sorted lists", "finds the largest element in a matrix",
    "checks whether two strings are anagrams", "implements a simple queue class", "computes the GCD of two numbers",
    "flattens a nested list", "counts the vowels in a string", "implements breadth-first search on a graph",
]
CODE_TEMPLATES = [
    "Write a {l} function that {c}.", "Write a {l} program that {c}.", "Implement a function in {l} that {c}.",
    "Develop a {l} program that {c}. Explain how it works.", "Write {l} code that {c}, with comments.",
    "Here is a task: write a function that {c}. Use {l}.",
]
CODE_QUESTIONS = [
    "Explain the difference between a list and a tuple in Python.", "What is recursion? Give an example.",
    "Explain big-O notation with examples.", "What is the difference between a process and a thread?",
    "How does a hash table work?", "What are the main principles of object-oriented programming?",
    "Explain what a REST API is.", "What is the difference between SQL and NoSQL databases?",
    "How does garbage collection work in Java?", "What is a closure in JavaScript?",
]

STEM_CONCEPTS = [
    "superposition", "quantum entanglement", "photosynthesis", "natural selection", "the greenhouse effect",
    "plate tectonics", "the Doppler effect", "entropy", "DNA replication", "the theory of relativity",
    "black holes", "nuclear fission", "the immune response", "electric current", "Newton's laws of motion",
    "chemical equilibrium", "the speed of sound", "cell division", "gravitational waves", "machine learning",
    "the carbon cycle", "antibiotic resistance", "semiconductors", "orbital mechanics", "enzymes",
    "the water cycle", "acids and bases", "the Big Bang", "vaccination", "climate feedback loops",
]
STEM_TEMPLATES = [
    "In the field of science, what is {c}?", "Explain {c} in simple terms.", "What is {c} and how does it relate to {d}?",
    "Describe {c} and give a real-world example.", "How does {c} work? Please justify your answer with principles "
    "of physics, chemistry or biology.", "Why is {c} important?", "What are common misconceptions about {c}?",
]
HUMANITIES_THEMES = [
    "economic growth", "inflation", "democracy", "the role of museums", "the stages of life", "free will",
    "globalisation", "the ethics of artificial intelligence", "social media and politics", "the welfare state",
    "colonialism", "the value of art", "freedom of speech", "the meaning of happiness", "unemployment",
    "the causes of the First World War", "religion and society", "urbanisation", "education systems",
    "the ancient Greek philosophers", "antitrust law", "cultural identity", "the printing revolution",
]
HUMANITIES_TEMPLATES = [
    "Provide insights into {h}.", "Discuss the impact of {h} on society.", "How does {h} shape our lives?",
    "Explain the main arguments for and against {h}.", "What can history teach us about {h}?",
    "Compare the views of two thinkers on {h}.", "Describe how {h} has changed over the last century.",
]

COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Kenya", "India", "Norway", "Mexico", "Egypt", "Australia",
             "Germany", "Peru", "Thailand", "Italy", "Spain", "Chile", "Vietnam", "Poland", "Ghana", "Sweden"]
QA_TEMPLATES = [
    "what is the capital of {k}", "who was the first president of {k}", "what language is spoken in {k}?",
    "when did {k} become independent?", "what is the population of {k}", "what currency is used in {k}?",
    "who wrote {b}?", "when was {b} published", "who plays the main character in the film {b}?",
    "who invented {i}?", "when was {i} invented", "where is {p} located?", "how tall is {p}",
    "who won the world cup in {y}", "who sang the song {s}", "when did {e} happen?", "what does {a} stand for",
    "how many {n} are there in the world?", "who is the author of the {b} series",
]
BOOKS = ["Pride and Prejudice", "Harry Potter", "The Hobbit", "Moby Dick", "War and Peace", "Dune", "Hamlet",
         "The Great Gatsby", "Don Quixote", "The Odyssey", "Frankenstein", "Little Women", "The Hunger Games"]
INVENTIONS = ["the telephone", "the light bulb", "the printing press", "the airplane", "penicillin", "the radio",
              "the steam engine", "the internet", "the television", "the bicycle", "the computer mouse"]
PLACES = ["the Eiffel Tower", "Mount Kilimanjaro", "the Statue of Liberty", "Machu Picchu", "the Taj Mahal",
          "Big Ben", "the Golden Gate Bridge", "Angkor Wat", "the Sydney Opera House", "Stonehenge"]
SONGS = ["Yesterday", "Hotel California", "Imagine", "Respect", "Let It Be", "Purple Rain", "Bohemian Rhapsody"]
EVENTS = ["the fall of the Berlin Wall", "the first moon landing", "the Battle of Hastings", "the French Revolution",
          "the signing of the Magna Carta", "the Great Depression", "the Chernobyl disaster"]
ACRONYMS = ["NASA", "DNA", "UNESCO", "HTML", "GDP", "NATO", "FIFA", "USB", "LED", "CPU"]
NOUNS = ["languages", "countries", "bones in the human body", "species of birds", "time zones", "oceans"]


def _qa(rng: random.Random) -> str:
    return rng.choice(QA_TEMPLATES).format(
        k=rng.choice(COUNTRIES), b=rng.choice(BOOKS), i=rng.choice(INVENTIONS), p=rng.choice(PLACES),
        y=rng.choice(range(1966, 2023, 4)), s=rng.choice(SONGS), e=rng.choice(EVENTS), a=rng.choice(ACRONYMS),
        n=rng.choice(NOUNS))


def _topic_prompt(rng: random.Random) -> str:
    t, u = rng.sample(TOPICS, 2)
    return rng.choice(TOPIC_TEMPLATES).format(t=t, u=u)


TOPIC_TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Give five interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?", "Describe the history of {t} in a few paragraphs.",
    "List three common misconceptions about {t} and correct them.", "Compare {t} with {u}.",
    "Write a dialogue between two friends discussing {t}.", "Answer briefly: what is the most important thing to "
    "know about {t}?", "What questions would a journalist ask an expert on {t}? Answer them too.",
]

SINGLE_STAGE = {
    "writing": lambda rng: rng.choice(WRITING_TEMPLATES).format(f=rng.choice(WRITING_FORMS).format(t=rng.choice(TOPICS))),
    "roleplay": lambda rng: rng.choice(ROLE_TEMPLATES).format(
        r=rng.choice(PERSONAS), q=rng.choice(ROLE_QUESTIONS).format(t=rng.choice(TOPICS))),
    "reasoning": _reasoning,
    "math": _math,
    "coding": lambda rng: (rng.choice(CODE_QUESTIONS) if rng.random() < 0.2 else
                           rng.choice(CODE_TEMPLATES).format(l=rng.choice(LANGUAGES), c=rng.choice(CODE_TASKS))),
    "stem": lambda rng: rng.choice(STEM_TEMPLATES).format(c=rng.choice(STEM_CONCEPTS), d=rng.choice(STEM_CONCEPTS)),
    "humanities": lambda rng: rng.choice(HUMANITIES_TEMPLATES).format(h=rng.choice(HUMANITIES_THEMES)),
    "qa": _qa,
    "topics": _topic_prompt,
}

# Two-stage families: stage 1 asks the target to write material, stage 2 works on what it wrote.
PASSAGE_WRITERS = {
    "translation": ["Write a short paragraph in German about {t}.", "Schreibe einen kurzen Zeitungsartikel über {t}.",
                    "Schreibe einen Absatz auf Deutsch über {t}."],
    "summarization": ["Write a news article about {t}.", "Write a detailed news report about {t}, with quotes.",
                      "Write a long magazine article about {t}."],
    "rag": ["Write an encyclopedia article about {t}.", "Write a detailed informative text about {t}."],
    "extraction": ["Write three short customer reviews of a product related to {t}, numbered 1 to 3.",
                   "Write a short report about {t} that mentions names, dates and numbers."],
}
RAG_QUESTIONS = ["What is the main point about {t}?", "Describe the key facts about {t}.",
                 "According to the text, why is {t} important?", "What does the passage say about the history of {t}?",
                 "Summarize what the text says about {t} in two sentences.", "Who or what is mentioned in connection "
                 "with {t}?"]
EXTRACTION_TASKS = [
    "Evaluate the following reviews on a scale of 1 to 5, with 1 being very negative and 5 very positive. "
    "Return the answer as a list of numbers.\n{p}",
    "Extract all names, dates and numbers from the following text and present them in JSON format.\n{p}",
    "Read the text below and list its key facts as bullet points.\n{p}",
    "Identify the main topic, the people involved and the overall sentiment of this text:\n{p}",
]


def _wmt_style(sentence: str) -> str:
    """Spaces around punctuation, as in tokenised news-translation test sets."""
    return re.sub(r"\s+", " ", re.sub(r"([,.;:!?\"()])", r" \1 ", sentence)).strip()


def stage_two(family: str, text: str, topic: str) -> list[str]:
    """Stage-2 prompts over ``text``, which the target wrote for a stage-1 prompt of ``family``."""
    text = text.strip()
    if not text:
        return []
    key = sum(map(ord, text)) + len(text)  # deterministic choice per text
    if family == "translation":
        sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")) if len(s.strip()) > 20]
        out = [f"Translate German to English: {_wmt_style(s) if (key + i) % 2 else s}" for i, s in enumerate(sents[:3])]
        if len(sents) > 1 and key % 3 == 0:
            out.append(f"Translate German to English: {' '.join(sents[:3])}")
        return out
    if family == "summarization":
        return [f"Summarize: {text}" if key % 4 else f"Summarize the following article in a few sentences.\n{text}"]
    if family == "rag":
        return [f"{text}\n{RAG_QUESTIONS[key % len(RAG_QUESTIONS)].format(t=topic)}"]
    if family == "extraction":
        return [EXTRACTION_TASKS[key % len(EXTRACTION_TASKS)].format(p=text)]
    raise ValueError(f"unknown passage family {family!r}")


def passage_writer_prompts(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """``n`` (stage-1 prompt, family, topic), the families in turn."""
    rng = random.Random(seed + 1)
    fams = list(PASSAGE_WRITERS)
    out = []
    for i in range(n):
        fam = fams[i % len(fams)]
        t = rng.choice(TOPICS)
        out.append((rng.choice(PASSAGE_WRITERS[fam]).format(t=t), fam, t))
    return out


def builtin_prompts(passages: list[str], n: int, seed: int = 0) -> list[str]:
    """``n`` varied single-stage prompts, the families in turn; every fifth family slot is a task over one
    of ``passages`` (e.g. the corpus's own questions) when there are any."""
    rng = random.Random(seed)
    fams = list(SINGLE_STAGE.values())
    out = []
    for i in range(n):
        if passages and i % 10 == 9:
            out.append(rng.choice(PASSAGE_TEMPLATES).format(p=rng.choice(passages)))
        else:
            out.append(fams[i % len(fams)](rng))
    return out


PASSAGE_TEMPLATES = [
    "{p} Solve this step by step.", "{p}", "{p} Explain your answer.",
    "Summarize the following text in one sentence: {p}", "Translate English to German: {p}",
    "Extract every number in the following text and say what it refers to: {p}",
]
