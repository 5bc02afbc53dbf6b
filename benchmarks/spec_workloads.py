"""The speculative-decoding section's three workloads, built here and deterministic: texts to copy from, records to
extract as JSON with a fixed-key schema, and short open questions.

- ``copy``: about 400-token prompts, a passage of three paragraphs with a task whose answer copies from it
  (repeat a paragraph, extract the sentences that mention a word, rewrite it with a word replaced);
- ``json``: a staff-directory entry to turn into a JSON object of fixed keys (``SCHEMA``), its values copied
  from the entry, its keys and punctuation forced by the grammar;
- ``chat``: short open questions, whose answers the prompt does not contain.

Each gives 16 conversations, ``copy_share`` says how much of an output was copied from its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PASSAGES: tuple[tuple[str, str, str], ...] = (
    # (title, keyword for the extraction task, text)
    (
        "the harbour committee's minutes",
        "ferry",
        "The harbour committee met on Tuesday evening in the library annex, with eleven members present and two "
        "apologies. The chair opened the meeting by thanking the volunteers who repainted the railings along the "
        "north quay in September. The treasurer reported that the repair fund now holds a little over fourteen "
        "thousand pounds, most of it from the summer fair and the mooring fees.\n\n"
        "The main item was the ferry timetable for the winter. The operator has proposed to cut the early ferry "
        "on weekdays from November to February, because fewer than ten passengers used it on most mornings last "
        "year. Several members said that nurses and school staff depend on the early ferry to reach the mainland "
        "on time. The committee agreed to ask the operator to keep the early ferry on Mondays and Fridays, and to "
        "run a smaller boat on the other days if the large one is too costly.\n\n"
        "Under other business, the harbour master warned that the slipway on the east side is slippery at low "
        "tide and should not be used after dark until the algae has been cleared. A new notice board will be put "
        "up beside the ticket office, listing the ferry times, the tide tables and the contact number for the "
        "coastguard. The next meeting will be held on the first Tuesday of December at seven o'clock.",
    ),
    (
        "the laboratory procedure",
        "buffer",
        "Before the experiment begins, every bench must be wiped with seventy percent ethanol and left to dry. "
        "Gloves and safety glasses are required at all times, and long hair must be tied back. Each group will "
        "receive a labelled tray with two beakers, a magnetic stirrer, a pH meter and a set of pipettes.\n\n"
        "To prepare the phosphate buffer, dissolve 2.7 grams of sodium phosphate in 800 millilitres of distilled "
        "water and stir until the solution is clear. Calibrate the pH meter with the standard solutions of pH 4 "
        "and pH 7 before measuring. Adjust the buffer to pH 7.4 by adding hydrochloric acid drop by drop, then "
        "bring the volume to one litre with distilled water. Label the bottle with the date, the pH and your "
        "initials, and keep the buffer in the cold room for no longer than two weeks.\n\n"
        "When the samples arrive, thaw them on ice and spin them for one minute to collect the liquid at the "
        "bottom of the tube. Dilute each sample ten times in the buffer and load twenty microlitres into each well "
        "of the plate. Record the readings every five minutes for one hour. At the end of the session, rinse the "
        "glassware, return the pipettes to their rack and write your results in the shared notebook.",
    ),
    (
        "the history of the lighthouse",
        "keeper",
        "The lighthouse on Gull Point was built in 1858 after three ships were wrecked on the reef in a single "
        "winter. Its tower is forty metres tall and made of granite blocks brought by sea from a quarry in the "
        "south. The first lamp burned whale oil, and its light could be seen from twenty miles away on a clear "
        "night.\n\n"
        "For almost a century the light was tended by a keeper and two assistants, who lived with their families "
        "in the cottages at the foot of the tower. The keeper wound the clockwork that turned the lens every four "
        "hours, trimmed the wicks and kept a log of the weather and of every ship that passed. In 1921 the keeper "
        "and his son rowed out in a storm and rescued the crew of a fishing boat, for which they were given a "
        "medal by the lifeboat society.\n\n"
        "The lamp was changed to electricity in 1952, and the light became automatic in 1987, when the last "
        "keeper left the point. Today the cottages hold a small museum with the old lens, the logbooks and a "
        "model of the reef. The tower is open to visitors on summer weekends, and from the gallery at the top you "
        "can see the whole coast from the estuary to the cliffs.",
    ),
    (
        "the coffee machine's support article",
        "descale",
        "If your coffee machine is slow to heat or the coffee tastes bitter, it may need cleaning. Switch the "
        "machine off, unplug it and let it cool for at least thirty minutes before you touch the brewing unit. "
        "Remove the water tank, the drip tray and the grounds container, and wash them in warm soapy water.\n\n"
        "Every three months you should descale the machine, or sooner if you live in an area with hard water. "
        "Fill the water tank with half a litre of water and one sachet of descaling solution, place a large bowl "
        "under the spout and hold the steam button for five seconds to start the program. The machine will pump "
        "the solution through the system in short bursts for about twenty minutes. When the light turns green, "
        "empty the bowl, rinse the tank and run the program again with clean water only.\n\n"
        "Do not use vinegar to descale the machine, because it can damage the seals and void the warranty. If "
        "the red light keeps flashing after you descale, check that the tank is seated properly and that the "
        "float inside it moves freely. If the problem remains, contact our support team with the serial number "
        "printed under the drip tray, and we will arrange a repair or a replacement.",
    ),
)

# (old, new) word pairs for the rewrite task, one per passage
REPLACEMENTS = (
    ("committee", "council"),
    ("beakers", "flasks"),
    ("tower", "column"),
    ("machine", "appliance"),
)


def copy_conversations() -> list[list[dict[str, str]]]:
    """16 conversations: each passage with four tasks whose answers copy from it."""
    out = []
    for (title, keyword, text), (old, new) in zip(PASSAGES, REPLACEMENTS):
        second = text.split("\n\n")[1]
        tasks = (
            f"Here is {title}.\n\n{text}\n\nRepeat the second paragraph word for word.",
            f'Here is {title}.\n\n{text}\n\nExtract the sentences that mention the word "{keyword}", exactly '
            "as they are written, one per line.",
            f'Here is a paragraph of {title}.\n\n{second}\n\nRewrite this paragraph with the word "{old}" '
            f'replaced by "{new}" everywhere, and nothing else changed. Then write the paragraph that follows '
            f"it in the full text below.\n\n{text}",
            f"Here is {title}.\n\n{text}\n\nCopy the first and the last paragraph exactly, in that order.",
        )
        out.extend([{"role": "user", "content": task}] for task in tasks)
    return out


_TEXT = {"type": "string", "maxLength": 80}  # bounded, so a small model's run-on value ends
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": _TEXT,
        "job_title": _TEXT,
        "department": _TEXT,
        "office": _TEXT,
        "email": _TEXT,
        "phone": _TEXT,
        "languages": {"type": "array", "items": _TEXT, "maxItems": 4},
        "current_project": _TEXT,
    },
    "required": [
        "name",
        "job_title",
        "department",
        "office",
        "email",
        "phone",
        "languages",
        "current_project",
    ],
}

_PEOPLE = (
    (
        "Margaret Okafor",
        "senior data engineer",
        "Analytics",
        "Leeds",
        ("English", "Igbo"),
        "the sales dashboard",
    ),
    (
        "Tomás Herrera",
        "payroll officer",
        "Finance",
        "Valencia",
        ("Spanish", "Catalan", "English"),
        "the pension reform",
    ),
    (
        "Ingrid Lindqvist",
        "product designer",
        "Design",
        "Gothenburg",
        ("Swedish", "German"),
        "the mobile check-in",
    ),
    (
        "Rahul Mehta",
        "security analyst",
        "IT Security",
        "Pune",
        ("Hindi", "Marathi", "English"),
        "the password audit",
    ),
    (
        "Claire Dubois",
        "legal counsel",
        "Legal",
        "Lyon",
        ("French", "Italian"),
        "the supplier contracts review",
    ),
    (
        "Kenji Watanabe",
        "warehouse manager",
        "Logistics",
        "Nagoya",
        ("Japanese", "English"),
        "the new loading bay",
    ),
    ("Amara Nwosu", "recruitment lead", "People", "Abuja", ("English", "Hausa"), "the graduate programme"),
    (
        "Piotr Kowalski",
        "quality engineer",
        "Manufacturing",
        "Gdansk",
        ("Polish", "Russian"),
        "the weld inspection",
    ),
)
_FLOORS = ("second", "third", "fourth", "fifth")


def json_conversations() -> list[list[dict[str, str]]]:
    """16 conversations: a directory entry each, to be written as a JSON object of ``SCHEMA``'s keys."""
    out = []
    for i in range(16):
        name, title, department, city, languages, project = _PEOPLE[i % len(_PEOPLE)]
        if i >= len(_PEOPLE):  # a colleague in the same team: other contact details and floor
            name = (
                name.split()[0]
                + " "
                + ("Grant", "Silva", "Berg", "Rao", "Martin", "Sato", "Eze", "Nowak")[i % 8]
            )
        first, last = name.lower().split()[0], name.lower().split()[-1]
        email = f"{first}.{last}@northwind-example.com"
        phone = f"+44 113 496 {1000 + 37 * i:04d}"
        office = f"{city}, {_FLOORS[i % 4]} floor"
        entry = (
            f"{name} joined the company {3 + i % 5} years ago and works as {title} in the {department} department. "
            f"You can find {name.split()[0]} in the {city} office on the {_FLOORS[i % 4]} floor, or reach them by "
            f"email at {email} or by phone on {phone}. {name.split()[0]} speaks {', '.join(languages[:-1])} and "
            f"{languages[-1]}, and is currently working on {project}. Outside work, {name.split()[0]} enjoys "
            "cycling, board games and the occasional pub quiz."
        )
        del office  # the model writes it from the entry
        out.append(
            [
                {
                    "role": "user",
                    "content": f"Staff directory entry:\n\n{entry}\n\nWrite this entry as a JSON object with the keys "
                    "name, job_title, department, office, email, phone, languages and current_project, copying the "
                    "values from the entry.",
                }
            ]
        )
    return out


QUESTIONS = (
    "What are some good ways to learn a new language as an adult?",
    "Why is the sky blue?",
    "Give me three ideas for a rainy Sunday afternoon.",
    "How do I keep basil alive on a windowsill?",
    "What makes a good first sentence in a short story?",
    "Explain what a budget is to a ten-year-old.",
    "What should I pack for a weekend of hiking?",
    "Why do cats purr?",
    "How can I get better at remembering names?",
    "What is the difference between weather and climate?",
    "Suggest a simple dinner I can cook in twenty minutes.",
    "How do bees make honey?",
    "What are the benefits of walking every day?",
    "Write a short poem about the sea.",
    "How does a bicycle stay upright?",
    "What is a good way to start learning to draw?",
)


def chat_conversations() -> list[list[dict[str, str]]]:
    """16 short open questions."""
    return [[{"role": "user", "content": question}] for question in QUESTIONS]


def copy_share(prompt: Sequence[int], output: Sequence[int], n: int = 4) -> float:
    """The share of ``output``'s tokens that lie in an ``n``-gram of it also found in ``prompt``: how much of the
    output was copied (0 when the output is shorter than ``n``)."""
    if len(output) < n:
        return 0.0
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(output)
