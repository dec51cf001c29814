"""Build the positive-review prompt files, deterministically.

    python -m quartet.tasks.positive_review.build      # rewrites train/eval/sft.jsonl next to this file

Prompts ask for a short movie review continuing an opening that does not decide the sentiment: it
is neutral (a premise) or mixed (one strength and one flaw), so a policy can still move its answers
towards positive. Titles are split between train and eval, so eval prompts mention films never seen
in training. ``sft.jsonl`` holds short demonstrations of the format with mixed sentiment (positive,
negative and neutral in equal shares), so SFT teaches "one or two sentences" without already
maximising the gold score.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from quartet.atomic import atomic_write_text

HERE = Path(__file__).parent
SEED = 0
N_TRAIN, N_EVAL, N_SFT = 480, 96, 198

TITLES = [
    "The Silent Harbor", "Paper Lanterns", "Northbound", "The Glass Orchard", "Midnight Ferry",
    "A Quiet Inheritance", "Salt and Iron", "The Last Cartographer", "Borrowed Summers", "Static",
    "The Hollow Crown Hotel", "Ember Road", "Little Deserts", "The Tin Astronomer", "Cold Water Blues",
    "Second Harvest", "The Weight of Snow", "Parallel Street", "Copper Bells", "The Understudy",
    "Wolf Hour", "Lemon Grove", "The Ninth Floor", "Drift", "Harbor Lights Motel", "The Long Table",
    "Blue Meridian", "Sawdust Kings", "The Apartment Below", "Foxglove", "Radio Silence",
    "The Orchard Thief", "Night Shift at Kessler's", "Riverbend", "The Chalk Line", "Low Tide",
    "The Patient Machine", "Dust Over Marlow", "A Map of Small Things", "Greyhound Summer",
    "The Bellmaker", "Velvet Static", "Those Who Stayed", "The Fourth Window", "Lantern Bay",
    "Crooked Timber", "The Winter Archive", "Open Water",
]
N_EVAL_TITLES = 8  # the last 8 titles appear only in eval prompts

FILMS = [  # (genre, premise)
    ("slow-burning thriller", "a lighthouse keeper who finds a stranger's diary"),
    ("family drama", "three siblings selling their late father's farm"),
    ("science-fiction film", "a crew repairing a relay station at the edge of the solar system"),
    ("romantic comedy", "two rival bakers forced to share a kitchen"),
    ("heist movie", "a retired safecracker pulled into one last job"),
    ("coming-of-age story", "a teenager spending a summer at her grandmother's motel"),
    ("documentary", "the last typewriter repair shop in Chicago"),
    ("horror film", "a family that moves into a house with a locked attic"),
    ("courtroom drama", "a public defender taking on an impossible case"),
    ("animated adventure", "a paper bird trying to find its way home"),
    ("war drama", "radio operators stationed on a remote island"),
    ("mystery", "a small-town librarian investigating a missing book"),
    ("musical", "a jazz band touring small towns in the 1950s"),
    ("western", "a sheriff and an outlaw stranded in a snowstorm"),
    ("biopic", "an amateur astronomer who discovered a comet"),
    ("sports drama", "an aging boxer training his daughter"),
    ("satire", "an advertising agency pitching a product nobody understands"),
    ("road movie", "two estranged brothers driving their mother's ashes across the country"),
    ("fantasy epic", "a cartographer mapping a kingdom that keeps changing shape"),
    ("psychological drama", "a pianist who begins to lose her hearing"),
    ("crime drama", "a night-shift taxi driver who witnesses a robbery"),
    ("period piece", "a lady's maid in an English country house"),
    ("disaster movie", "a town evacuating ahead of a flood"),
    ("indie comedy", "a wedding planner who has never been to a wedding"),
]

STRENGTHS = [
    "the cinematography is striking", "the lead performance is committed", "the score is memorable",
    "the dialogue is sharp", "the production design is detailed", "the final scene lands",
    "the supporting cast is lively", "the opening scene is gripping",
]
FLAWS = [
    "the pacing drags in the middle", "the plot has obvious holes", "the ending feels rushed",
    "the dialogue is often clumsy", "the runtime is far too long", "the villain is thinly written",
    "the tone is uneven", "the editing is choppy",
]

NEUTRAL_OPENINGS = [
    "I watched {title} last night, {a_genre} about {premise}.",
    "{title} is {a_genre} about {premise}, and it runs just under two hours.",
    "I finally caught {title}, the new {genre} about {premise}.",
    "My friend and I saw {title} on Sunday; it is {a_genre} about {premise}.",
    "{title}, {a_genre} about {premise}, opened in a handful of theaters this week.",
    "Going into {title}, {a_genre} about {premise}, I did not know what to expect.",
]
MIXED_OPENINGS = [
    "{title} is {a_genre} about {premise}; {flaw}, but {strength}.",
    "In {title}, {a_genre} about {premise}, {strength}, although {flaw}.",
    "I saw {title}, {a_genre} about {premise}. {Flaw}, yet {strength}.",
    "{title} tells the story of {premise}. {Strength}, while {flaw}.",
]
INSTRUCTIONS = [
    'Continue this movie review in one or two sentences: "{opening}"',
    "Here is the start of a movie review. Finish it in one or two sentences.\n\n{opening}",
    'Write a short movie review (one or two sentences) that begins: "{opening}"',
    'Complete the following review in at most two sentences: "{opening}"',
]

# Demonstrations: one or two sentences, equal shares of positive, negative and neutral verdicts.
ASPECTS = ["the acting", "the story", "the camera work", "the soundtrack", "the script", "the ending"]
SFT_REPLIES = {
    "positive": [
        "By the end I was completely won over; {aspect} is wonderful and I would happily watch it again.",
        "It turns out to be a delight, and {aspect} is the best part. Highly recommended.",
        "A warm, funny and moving film, and {aspect} is excellent throughout.",
        "{title} is a real treat: {aspect} is beautifully done and the time flies by.",
        "I left the theater smiling; {aspect} alone makes it worth seeing, and the rest is great too.",
        "It is one of the most enjoyable films I have seen this year, with {aspect} a clear highlight.",
    ],
    "negative": [
        "Unfortunately it never recovers, and {aspect} is dull and forgettable. I would skip it.",
        "Sadly {aspect} is a mess, and the whole thing left me bored and annoyed.",
        "It is a disappointing film; {aspect} is weak and the story falls apart.",
        "{title} wastes its premise, and {aspect} is the worst part of it.",
        "I was bored and checked my watch more than once; {aspect} is dull and lifeless.",
        "By the last act I had stopped caring, and {aspect} is painfully bad.",
    ],
    "neutral": [
        "It follows the usual pattern of the genre, and {aspect} is about what you would expect.",
        "The film runs a little under two hours, and {aspect} shifts halfway through.",
        "Most of it takes place in one location, and {aspect} stays in the background.",
        "The film was shot on location, and {aspect} is in line with the genre.",
        "It opens in more theaters next month, and {aspect} will feel familiar to fans of the genre.",
        "The story is told in chronological order, and {aspect} is fairly conventional.",
    ],
}


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _openings(titles: list[str]) -> list[str]:
    out = []
    for title in titles:
        for genre, premise in FILMS:
            for tpl in NEUTRAL_OPENINGS:
                out.append(tpl.format(title=title, genre=genre, a_genre=_a(genre), premise=premise))
            for i, tpl in enumerate(MIXED_OPENINGS):
                strength = STRENGTHS[(hash_str(title) + i) % len(STRENGTHS)]
                flaw = FLAWS[(hash_str(premise) + 3 * i) % len(FLAWS)]
                out.append(tpl.format(title=title, genre=genre, a_genre=_a(genre), premise=premise, strength=strength,
                                      flaw=flaw, Strength=_cap(strength), Flaw=_cap(flaw)))
    return out


def hash_str(text: str) -> int:
    """A stable (not PYTHONHASHSEED-dependent) small hash."""
    return sum((i + 1) * ord(c) for i, c in enumerate(text))


def _prompts(titles: list[str], n: int, rng: random.Random) -> list[str]:
    openings = _openings(titles)
    rng.shuffle(openings)
    prompts, seen = [], set()
    for k, opening in enumerate(openings):
        text = INSTRUCTIONS[k % len(INSTRUCTIONS)].format(opening=opening)
        if text not in seen:
            seen.add(text)
            prompts.append(text)
        if len(prompts) == n:
            return prompts
    raise RuntimeError(f"only {len(prompts)} distinct prompts, wanted {n}")


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    train = _prompts(TITLES[:-N_EVAL_TITLES], N_TRAIN, rng)
    eval_ = _prompts(TITLES[-N_EVAL_TITLES:], N_EVAL, rng)
    sft = []
    kinds = list(SFT_REPLIES)
    for i, prompt in enumerate(rng.sample(train, N_SFT)):
        title = next(t for t in TITLES if t in prompt)
        kind = kinds[i % len(kinds)]
        reply = rng.choice(SFT_REPLIES[kind]).format(aspect=rng.choice(ASPECTS), title=title)
        sft.append({"prompt": prompt, "completion": reply, "sentiment": kind})
    return {
        "train": [{"prompt": p} for p in train],
        "eval": [{"prompt": p} for p in eval_],
        "sft": sft,
    }


def main() -> None:
    for split, rows in build().items():
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        atomic_write_text(HERE / f"{split}.jsonl", text)
        print(f"{split}: {len(rows)} rows")


if __name__ == "__main__":
    main()
