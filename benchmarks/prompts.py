"""Fixed prompts for the specgraph benchmarks.

``PROMPTS`` holds 3 code and 3 chat prompts (plain user messages; the benchmark applies the
model's chat template). ``SHARED_DOCUMENT`` is a long document used as the shared prefix of
the prefix-caching test (truncated there to an exact token count), ``PREFIX_QUESTIONS`` are
the different questions asked after it, and ``WARMUP_PROMPT`` is used only to warm modes up,
so no timed prompt is ever seen (or prefix-cached) before it is timed.
"""
from __future__ import annotations

CODE_PROMPTS = [
    "Write a Python function `merge_intervals(intervals)` that takes a list of (start, end) tuples, "
    "merges every overlapping interval and returns the merged list sorted by start. Add a docstring "
    "and two short usage examples.",
    "Implement a small LRU cache class in Python with `get(key)` and `put(key, value)` methods that "
    "both run in O(1) time. Use only the standard library and explain the data structures you chose.",
    "Write a SQL query that returns, for every customer, the total amount spent in 2023 and the date "
    "of their most recent order, from the tables `customers(id, name)` and "
    "`orders(id, customer_id, amount, created_at)`. Sort by total amount, highest first.",
]

CHAT_PROMPTS = [
    "I have a job interview for a junior data analyst position next week. What should I prepare, "
    "and which questions are they likely to ask me?",
    "Explain to a twelve-year-old why the sky is blue during the day but red and orange at sunset.",
    "Plan a relaxed three-day trip to Lisbon for two people who like food, museums and walking. "
    "Give a short plan for each day.",
]

PROMPTS: list[tuple[str, str]] = [("code", p) for p in CODE_PROMPTS] + [("chat", p) for p in CHAT_PROMPTS]

# More tuning material for the controller replay (benchmarks/replay_controller.py), never a report set.
REPLAY_CODE_PROMPTS = [
    "Write a Python class `Matrix` with addition, multiplication and transpose, using lists of lists. "
    "Include a __repr__.",
    "Refactor this function to avoid repeated code:\n\ndef area(shape, a, b=None):\n    if shape == 'square':\n"
    "        return a * a\n    if shape == 'rect':\n        return a * b\n    if shape == 'circle':\n"
    "        return 3.14159 * a * a\n",
    "Write a bash script that finds every .log file older than 7 days under /var/log/app and compresses it "
    "with gzip.",
    "Write a JavaScript function that debounces another function, with a short example of its use.",
    "Fix the bug in this Python code and explain it:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total / len(xs) if xs else total / 0\n",
]

REPLAY_CHAT_PROMPTS = [
    "What are some good habits for getting better sleep?",
    "Write a short poem about autumn in a small town.",
    "Compare cats and dogs as pets for someone who lives in a small apartment.",
    "How does compound interest work? Give a simple example.",
    "Give me five ideas for a birthday party for a seven-year-old.",
]

# The adaptive-speculation benchmark's report set: the controller's constants were never tuned
# on these (they were set before, and checked on PROMPTS above). Code prompts with code to
# edit, where the answer copies from the prompt, and code to write from scratch; chat prompts.
HELDOUT_CODE_PROMPTS = [
    "Add type hints and a docstring to this function, keeping its behaviour:\n\n"
    "def chunk(items, size):\n    out = []\n    for i in range(0, len(items), size):\n"
    "        out.append(items[i:i + size])\n    return out\n",
    "Rewrite this loop as a list comprehension and explain the change:\n\n"
    "result = []\nfor word in words:\n    if len(word) > 3 and word.isalpha():\n"
    "        result.append(word.lower())\n",
    "Write a Python function `parse_duration(text)` that turns strings like '1h30m', '45s' or "
    "'2h' into a number of seconds, raising ValueError on anything else.",
    "Write a bash script that finds every `.log` file older than seven days under a directory "
    "given as its first argument, compresses it with gzip and prints how many files it handled.",
]

HELDOUT_CHAT_PROMPTS = [
    "My tomato plants have yellow leaves at the bottom. What could be wrong, and what should I do?",
    "Give me three ideas for a birthday party for a seven-year-old who loves dinosaurs.",
    "What are the pros and cons of renting versus buying a flat in a big city?",
    "Write a short, friendly message to my neighbour asking them to keep the noise down after 10 pm.",
]

# Used only for warm-up calls (never timed).
WARMUP_PROMPT = "List three prime numbers greater than ten."

# Shared prefix for the prefix-caching test: a long system "document". The benchmark tokenizes
# it and keeps exactly as many tokens as it needs (512 by default), so it is deliberately longer.
SHARED_DOCUMENT = """\
Harbor Line Railway: operations handbook for station staff (revision 7).

1. Purpose. This handbook describes how station staff on the Harbor Line keep trains, platforms \
and passengers safe and on time. It applies to the nine stations between Northgate and the \
Ferry Terminal, including the two underground stations at Market Square and City Hall. Staff \
must read it once a year and whenever a new revision is issued.

2. Opening a station. The opening supervisor arrives forty minutes before the first train. They \
switch on platform lighting, test the public address system on every platform, check that all \
ticket machines accept cards and coins, and walk the full length of each platform looking for \
obstructions, spills or damaged tactile paving. Lifts and escalators are started only after a \
visual inspection of the landings. Any fault is logged in the station book with the time, the \
equipment number and the name of the person who found it, and is reported to the control room \
by radio before the station opens to the public.

3. Train dispatch. A train may only be dispatched when the platform starting signal shows a \
proceed aspect, all doors are closed and the interlock light is lit, and the platform-train \
interface is clear. The dispatcher stands at the marked position, checks the monitor or the \
mirror for the whole length of the train, and gives the ready-to-start signal to the driver. \
If a passenger is trapped in a door, the dispatcher immediately shows a stop signal and \
presses the emergency plunger. Trains are never dispatched while a person is running towards \
the doors.

4. Delays and disruption. When a delay of more than five minutes is expected, staff announce it \
on the public address system every five minutes, give the reason if it is known, and update \
the departure screens. For delays longer than twenty minutes, the station supervisor asks the \
control room whether replacement buses will run and, if so, from which stop. Staff must not \
guess restoration times; they repeat only times given by the control room. Passengers who \
will miss a connection are directed to the information desk, where staff can endorse tickets \
for travel on the next available service or on partner bus routes.

5. Accessibility. Passengers who need help boarding are met at the station entrance or at the \
ticket office. Staff place the boarding ramp at the second door of the front carriage, which \
stops opposite the marked ramp position on every platform, and they phone the destination \
station so that a colleague is ready with a ramp on arrival. When a lift is out of service, \
staff arrange an accessible taxi to the nearest station with a working lift at no cost to the \
passenger, and record the journey in the assistance log.

6. Lost property. Items found on trains or platforms are tagged with the date, time, location \
and a short description, and are stored in the locked cupboard in the station office. Wallets, \
phones and keys are sent to the central lost property office at the Ferry Terminal at the end \
of each day. Perishable food is thrown away after one day. Passengers reclaiming an item must \
describe it and show identification, and they sign the lost property register.

7. Emergencies. In a fire alarm, staff follow the evacuation plan posted in the station office: \
stop the escalators, open the emergency gates, guide passengers to the assembly point and \
count staff at the roll-call board. Nobody re-enters the station until the fire service gives \
permission. For a medical emergency, staff call the ambulance service first, then the control \
room, and bring the defibrillator and first aid kit from the ticket office. Every incident is \
written up on the incident form before the end of the shift.

8. Closing a station. After the last train has departed, staff walk each platform and the \
concourse to make sure no passengers remain, close the entrance gates, switch off escalators \
and non-essential lighting, empty the ticket machine vaults into the safe, and hand the keys \
to the night security team with a signed handover sheet.
"""

PREFIX_QUESTIONS = [
    "According to the handbook, what must staff check before dispatching a train?",
    "What happens to a lost wallet that is found on a platform?",
    "How should staff help a passenger in a wheelchair when the lift is broken?",
    "How often must delays be announced, and what should staff avoid saying?",
]
