"""General chat requests for training drafts: templates filled from hand-written topic lists.

The standard library's docstrings (`train_draft.build_prompts`) make the target explain code;
these make it answer the everyday requests a chat model sees: explanations, how-tos, lists of
tips, comparisons, short stories and poems, emails, small programs. Every request is built
here from the lists below, so nothing is downloaded, and `check_disjoint` keeps them apart from
an evaluation set: no topic may occur in an evaluation prompt, and no request may equal one.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

# Each entry: a template and the values of its one slot `{x}`.
REQUESTS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (
        (
            "Explain how {x} works.",
            "Explain {x} to a ten-year-old.",
            "What is {x}? Answer in a short paragraph.",
            "Give me a simple explanation of {x}.",
        ),
        (
            "photosynthesis in desert plants",
            "a refrigerator",
            "the stock market",
            "compound interest",
            "vaccines",
            "an electric motor",
            "the immune system",
            "a microwave oven",
            "tides in the ocean",
            "gravity",
            "inflation",
            "a solar panel",
            "the internet",
            "an earthquake",
            "a volcano",
            "the human heart",
            "a credit score",
            "democracy",
            "a lighthouse",
            "GPS navigation",
            "a thermostat",
            "the moon's phases",
            "evolution by natural selection",
            "supply and demand",
            "a hybrid car",
            "the greenhouse effect",
            "a password manager",
            "an airplane wing",
            "digestion",
            "a nuclear power plant",
            "encryption",
            "a camera lens",
            "a blockchain",
            "the Northern Lights",
            "a submarine",
            "sound waves",
            "a wind turbine",
            "the kidneys",
            "public libraries",
            "a compass",
        ),
    ),
    (
        (
            "Give me {n} tips for {x}.",
            "What are the best ways to get better at {x}?",
            "How can a beginner start {x}?",
            "I want to improve at {x}. Where should I start?",
        ),
        (
            "public speaking",
            "saving money",
            "running a first marathon",
            "keeping houseplants alive",
            "drawing portraits",
            "playing chess",
            "writing a resume",
            "cooking for a family on a budget",
            "managing time at work",
            "learning to swim",
            "taking photos with a phone",
            "gardening on a balcony",
            "playing the guitar",
            "making new friends in a new city",
            "writing fiction",
            "meditating",
            "negotiating a salary",
            "organizing a small closet",
            "keeping a journal",
            "baking bread",
            "touch typing",
            "reading more books",
            "hiking in the mountains",
            "training a puppy",
            "staying calm before an exam",
            "learning to code",
            "giving constructive feedback",
            "decluttering a kitchen",
            "practicing the piano",
            "knitting",
        ),
    ),
    (
        ("What is the difference between {x}?", "Compare {x}.", "How do {x} differ?"),
        (
            "a lake and a pond",
            "a crocodile and an alligator",
            "a list and a tuple in Python",
            "a comet and an asteroid",
            "stocks and bonds",
            "a hurricane and a tornado",
            "RAM and storage",
            "a simile and a metaphor",
            "baking soda and baking powder",
            "a frog and a toad",
            "HTTP and HTTPS",
            "a democracy and a monarchy",
            "a latte and a cappuccino",
            "renting and buying a home",
            "a novel and a short story",
            "speed and velocity",
            "an ocean and a sea",
            "a mountain and a hill",
            "a debit card and a credit card",
            "a star and a planet",
            "a psychologist and a psychiatrist",
            "a rabbit and a hare",
            "TCP and UDP",
            "an alto and a soprano",
            "a violin and a viola",
        ),
    ),
    (
        (
            "Write a short story about {x}.",
            "Tell me a bedtime story about {x}.",
            "Write the opening paragraph of a novel about {x}.",
        ),
        (
            "a lighthouse keeper who finds a message in a bottle",
            "a dragon who is afraid of the dark",
            "two friends lost in a city at night",
            "a girl who can talk to trees",
            "a detective mouse",
            "a spaceship crew that discovers an empty planet",
            "an old clockmaker",
            "a dog waiting at a train station",
            "a village where it never stops snowing",
            "a boy who builds a kite",
            "a library that opens only at midnight",
            "a pirate who hates the sea",
            "a lonely snowman",
            "a chef who loses her sense of taste",
            "a time traveler stuck in the year 1900",
            "a penguin who wants to fly",
            "a musician who plays for the stars",
            "a fox and a crow who become friends",
        ),
    ),
    (
        ("Write a poem about {x}.", "Write a haiku about {x}.", "Write four rhyming lines about {x}."),
        (
            "the ocean at night",
            "a city in the rain",
            "the first snow of winter",
            "an old oak tree",
            "friendship",
            "a cup of morning coffee",
            "the desert",
            "a summer thunderstorm",
            "a train journey",
            "the stars",
            "a quiet library",
            "spring flowers",
            "the moon over a lake",
            "a mountain sunrise",
            "growing older",
        ),
    ),
    (
        ("Write a short, polite email {x}.", "Help me write a message {x}.", "Draft a note {x}."),
        (
            "asking a landlord to fix a leaking tap",
            "thanking a colleague for their help on a project",
            "declining a job offer",
            "inviting neighbors to a garden party",
            "apologizing for missing a meeting",
            "asking a teacher for an extension on homework",
            "complaining about a late delivery",
            "welcoming a new team member",
            "requesting a refund for a broken blender",
            "reminding a friend about money they owe",
            "asking for a letter of recommendation",
            "cancelling a gym membership",
            "following up after a job interview",
            "congratulating a friend on a new baby",
        ),
    ),
    (
        ("Write a Python function that {x}.", "Show me Python code that {x}, and explain it."),
        (
            "reverses a string",
            "counts the vowels in a sentence",
            "returns the largest number in a list",
            "checks whether a word is a palindrome",
            "computes the factorial of a number",
            "removes duplicates from a list while keeping the order",
            "converts Celsius to Fahrenheit",
            "reads a text file and counts its lines",
            "finds the most common word in a text",
            "merges two sorted lists",
            "returns the Fibonacci numbers up to n",
            "sorts a list of dictionaries by a key",
            "checks whether two words are anagrams",
            "flattens a nested list",
            "calculates the average of a list of numbers",
            "validates a simple email address",
            "generates a random password",
            "counts how often each letter appears",
            "converts a number to Roman numerals",
            "finds the second smallest number in a list",
        ),
    ),
    (
        (
            "How do I {x}?",
            "What are the steps to {x}?",
            "Give me step-by-step instructions to {x}.",
        ),
        (
            "boil an egg",
            "plant tomatoes",
            "tie a tie",
            "clean a cast-iron pan",
            "write a cover letter",
            "set up a monthly budget",
            "make a paper airplane",
            "back up my phone",
            "start a vegetable garden",
            "brew coffee with a French press",
            "remove a coffee stain from a shirt",
            "prepare for a job interview",
            "jump-start a car battery",
            "make a simple website",
            "fold a fitted sheet",
            "care for a goldfish",
            "make fresh pasta",
            "learn to juggle",
            "plan a road trip",
            "sharpen a kitchen knife",
            "paint a room",
            "make a smoothie",
            "build a birdhouse",
            "unclog a sink",
        ),
    ),
    (
        ("Why do {x}?", "Can you explain why {x}?"),
        (
            "cats purr",
            "leaves change color in the fall",
            "onions make people cry",
            "we dream",
            "birds migrate",
            "stars twinkle",
            "we get hiccups",
            "ice cubes float",
            "bread go stale",
            "people yawn",
            "the oceans taste salty",
            "airplanes leave white trails",
            "some people need glasses",
            "zebras have stripes",
            "our ears pop on an airplane",
            "metal feel colder than wood",
        ),
    ),
    (
        (
            "Tell me about {x}.",
            "Who was {x}, and why are they remembered?",
            "Give me a short biography of {x}.",
        ),
        (
            "Marie Curie",
            "Leonardo da Vinci",
            "Ada Lovelace",
            "Nelson Mandela",
            "Wolfgang Amadeus Mozart",
            "Galileo Galilei",
            "Frida Kahlo",
            "Alan Turing",
            "Cleopatra",
            "Charles Darwin",
            "Jane Austen",
            "Nikola Tesla",
            "Rosalind Franklin",
            "Mahatma Gandhi",
            "Amelia Earhart",
            "Johannes Gutenberg",
        ),
    ),
    (
        ("What is {x} famous for?", "Tell me some interesting facts about {x}.", "Describe {x} for a traveler."),
        (
            "Paris",
            "Egypt",
            "the Amazon rainforest",
            "Iceland",
            "Rome",
            "the Great Wall of China",
            "Australia",
            "New York City",
            "the Sahara",
            "Mount Everest",
            "Venice",
            "Brazil",
            "Canada",
            "the Galapagos Islands",
            "Kenya",
            "Norway",
            "Mexico City",
            "the Grand Canyon",
        ),
    ),
    (
        ("Describe {x}.", "Write a short description of {x}.", "What does a typical day look like for {x}?"),
        (
            "a busy farmers' market",
            "a nurse in a hospital",
            "a firefighter",
            "an ant colony",
            "a medieval castle",
            "a coral reef",
            "a baker",
            "a school teacher",
            "an astronaut on the space station",
            "a forest in winter",
            "a dolphin",
            "a train conductor",
            "a zookeeper",
            "a rainforest at dawn",
        ),
    ),
    (
        ("Give me {n} ideas for {x}.", "Suggest {n} ideas for {x}.", "List {n} ideas for {x}."),
        (
            "a science fair project",
            "a weekend trip with friends",
            "healthy school lunches",
            "a company team-building day",
            "a date night at home",
            "a short film",
            "gifts for a grandmother",
            "a vegetarian dinner",
            "a blog about travel",
            "things to do in the summer holidays",
            "a garden in a small backyard",
            "a board game night",
            "a picnic menu",
            "a podcast about history",
            "a mobile app",
        ),
    ),
    (
        ("What are the pros and cons of {x}?", "Should I consider {x}? Give me the arguments for and against."),
        (
            "working from home",
            "electric cars",
            "living in a big city",
            "social media for teenagers",
            "a four-day work week",
            "homeschooling",
            "buying a used car",
            "learning two languages at once",
            "owning a dog",
            "studying abroad",
            "nuclear energy",
            "a standing desk",
        ),
    ),
    (
        (
            "Explain {x} in programming.",
            "What is {x} in computer science? Give an example.",
            "Teach me about {x} with a short example.",
        ),
        (
            "recursion",
            "a hash table",
            "object-oriented programming",
            "a linked list",
            "big O notation",
            "a database index",
            "version control with git",
            "unit testing",
            "a binary search",
            "an operating system",
            "a compiler",
            "a stack and a queue",
            "multithreading",
            "regular expressions",
            "caching",
            "a REST endpoint",
        ),
    ),
    (
        ("How do you calculate {x}?", "Show me how to work out {x}, step by step."),
        (
            "the area of a circle",
            "a percentage discount",
            "the average of five numbers",
            "the volume of a cylinder",
            "simple interest on a loan",
            "the perimeter of a rectangle",
            "a tip at a restaurant",
            "the slope of a line",
            "the speed of a car from distance and time",
            "the median of a list of numbers",
            "the probability of rolling two sixes",
        ),
    ),
    (
        ("What are the health benefits of {x}?", "Is {x} good for you? Explain."),
        (
            "drinking water",
            "eating vegetables",
            "yoga",
            "walking every day",
            "eating fish",
            "spending time outdoors",
            "stretching",
            "dark chocolate",
            "cycling to work",
            "laughing",
        ),
    ),
    (
        ("Summarize the plot of {x}.", "What is {x} about?", "Retell {x} in a few sentences."),
        (
            "Romeo and Juliet",
            "Little Red Riding Hood",
            "The Odyssey",
            "Snow White",
            "Hamlet",
            "The Three Little Pigs",
            "Jack and the Beanstalk",
            "Alice's Adventures in Wonderland",
            "The Tortoise and the Hare",
            "Robinson Crusoe",
            "The Ugly Duckling",
            "Goldilocks and the Three Bears",
        ),
    ),
)

NUMBERS = ("three", "four", "five", "six", "seven")


def topics() -> list[str]:
    return [x for _, values in REQUESTS for x in values]


def all_requests() -> list[str]:
    """Every request the lists can make, in a fixed order."""
    out = []
    for i, (templates, values) in enumerate(REQUESTS):
        for j, (t, x) in enumerate(itertools.product(templates, values)):
            out.append(t.format(x=x, n=NUMBERS[(i + j) % len(NUMBERS)]))
    return out


def _words(text: str) -> str:
    return " " + " ".join(re.findall(r"[a-z0-9']+", text.lower())) + " "


def check_disjoint(eval_texts: list[str]) -> None:
    """Raises ValueError if a topic occurs in, or a request equals, an evaluation prompt."""
    evals = [_words(t) for t in eval_texts]
    for x in topics():
        w = _words(x)
        hit = next((e for e in evals if w in e), None)
        if hit is not None:
            raise ValueError(f"training topic {x!r} occurs in the evaluation prompt {hit.strip()!r}")
    requests = {_words(r) for r in all_requests()}
    for e in evals:
        if e in requests:
            raise ValueError(f"evaluation prompt {e.strip()!r} is also a training request")


def chat_prompts(num: int, *, seed: int) -> list[list[dict]]:
    """`num` single-turn conversations drawn without replacement from `all_requests()`."""
    requests = all_requests()
    if num > len(requests):
        raise ValueError(f"only {len(requests)} distinct chat requests, {num} asked")
    picks = np.random.default_rng(seed).choice(len(requests), size=num, replace=False)
    return [[{"role": "user", "content": requests[i]}] for i in picks]
