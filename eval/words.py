"""Words, numbers and UUIDs for the RULER tasks, drawn from a numpy Generator (seeded, offline).

RULER (github.com/NVIDIA/RULER, scripts/data/synthetic/niah.py) draws needle keys as "adjective-noun"
pairs from the `wonderwords` package's lists (millions of pairs), values as 7-digit numbers or UUID4s,
and the common-words task's words from wonderwords' nouns, adjectives and verbs (a larger English list
past that). Here the lists are shipped below (about 150 adjectives x 300 nouns = 45,000 keys; 600 words
in all for common-words extraction), and once a task needs more distinct words than that it continues
with pronounceable pseudo-words (consonant-vowel syllables, `pseudo_words`), so any length can be
filled without a download. Keys are always distinct within a sample, and from a sample's distractors.
"""

from __future__ import annotations

import uuid

import numpy as np

ADJECTIVES = tuple("""
able acid active agile airy alert amber ample ancient angry arctic ashen awake bald bare basic bent bitter
black bland blind blond blue bold bony brave brief bright brisk broad broken brown bumpy busy calm candid
careful cheap cheerful chilly civil clean clear clever close cloudy coarse cold cosmic cozy crisp cruel
curly curved damp dark dear deep dense dim dirty dizzy dry dull dusty eager early easy elder empty equal
even exact faint fair false famous fancy fast fat fierce filthy fine firm flat fluffy fond foolish fragile
frail free fresh friendly frozen full funny fuzzy gentle giant glad glossy golden good grand gray great
green grim gross hairy happy hard harsh heavy hidden high hollow honest hot huge humble hungry icy idle
jolly juicy keen kind large late lazy lean light little lively lonely long loose loud lovely low loyal lucky
mad magic major merry mild minor misty modern moist muddy narrow nasty neat nervous new nice noble noisy
odd old open orange pale perfect pink plain plump polite poor proud pure purple quick quiet rapid rare raw
red rich rigid ripe rough round royal rude rusty sad safe salty sandy scarce secret sharp shiny short shy
silent silly simple sleek slim slow small smart smooth soft solid sour spare spicy stale steep sticky stiff
stout strange strict strong sunny sweet swift tall tame tender thick thin tidy tight tiny tired tough
""".split())

NOUNS = tuple("""
acorn actor airport album alley anchor angle ankle apple apron arch arena arrow artist atlas attic avenue
badge bakery balcony ballet balloon bamboo banana bandit banjo barn barrel basket bath beach beacon bean
beard beaver bell belt bench berry bicycle bishop blanket blossom boat bonnet book boot bottle boulder
bowl bracelet branch bread brick bridge broom bubble bucket buffalo bugle bull bundle butter button cabin
cable cactus cake camel camera canal candle canoe canyon captain carpet carrot castle cattle cave cedar
cellar chair chalk chapel cherry chess chimney circus city clock cloud clover coast cobra coconut coffee
comet compass copper coral cottage cotton cousin cradle crane crater crayon cricket crown crystal cup
curtain cushion dagger daisy dancer desert diamond dinner doctor dolphin donkey door dragon drawer dream
drum duck eagle earth easel elbow elephant elm engine falcon farm feather fence ferry fiddle field finger
flag flame flute forest fork fossil fountain fox frog garden garlic gate ghost giraffe glacier glove goat
goblet gorilla grape grass guitar hammer harbor harp hat hawk helmet hill honey horizon horse hotel island
ivory jacket jaguar jar jelly jewel journal jungle kettle key kingdom kitchen kite knight ladder lake lamp
lantern lemon leopard letter lily lion lizard lobster locket lotus magnet mango maple marble market meadow
melon meteor mirror mitten monkey moon mountain mouse museum needle nest novel nutmeg oak ocean olive onion
orchard orchid otter owl oyster paddle palace panda panther paper parrot peach pearl pebble pencil pepper
piano pigeon pillow pine pirate planet plate plum pocket pond poppy potato prism puppet quail quarry queen
quilt rabbit raccoon radio rainbow raven reef ribbon river robot rocket rose saddle sailor salmon sandal
satchel scarf scroll shadow shark shell ship shovel silver skate sled snail socket soldier spider spoon
squirrel stable statue storm stove sugar summit swan sword table tablet teapot temple tent thimble thunder
tiger timber toast tomato tower tractor trumpet tulip tunnel turtle umbrella unicorn valley vase velvet
violin volcano wagon walnut walrus wand whale wheat whistle willow window wizard wolf yacht yarn zebra
""".split())

VERBS = tuple("""
accept admire allow answer appear arrive attack bake balance bathe behave belong blink boast boil borrow
bounce breathe bury calculate carry chase cheer chew clap climb collect command compare complain count
crawl cross dance decide deliver depend describe disappear divide drag dream drift drop earn educate
embrace employ enjoy escape examine explain explode fasten fetch fix float flow fold follow forgive gather
glow grab greet grin guard guess hammer hang happen hover hum hunt hurry identify imagine improve inform
inspect invent invite itch jog judge juggle kneel knit knock laugh launch learn lift listen march marry
measure melt mend mix murmur nod notice obey observe offer open order paint pause peel perform pinch plant
please polish pour pray preach pretend print promise protect pull punish push question race rain reach
record reflect relax remain remember repair repeat reply rescue return rhyme rinse roll rub rush sail
scatter scold scream search settle shiver sigh signal skip slide smash sneeze sniff snore spark spell
spill spray sprout squeeze stamp stare steer stir stitch stretch strip suggest supply surround suspect
swim tackle tease tempt thank tickle travel tremble trot trust tumble twist unite unlock vanish visit
wander warn wash watch wave weigh whisper wink wobble wonder wrap yawn yell zip zoom
""".split())

_CONSONANTS = np.array(list("bdfgklmnprstvz"))
_VOWELS = np.array(list("aeiou"))


def pseudo_words(rng: np.random.Generator, n: int, syllables: int = 3) -> list[str]:
    """`n` distinct pronounceable pseudo-words of `syllables` consonant-vowel pairs ("kodali")."""
    seen: dict[str, None] = {}
    while len(seen) < n:
        c = rng.choice(_CONSONANTS, size=(2 * (n - len(seen)) + 8, syllables))
        v = rng.choice(_VOWELS, size=c.shape)
        for row_c, row_v in zip(c, v):
            seen.setdefault("".join(a + b for a, b in zip(row_c, row_v)), None)
    return list(seen)[:n]


def english_words() -> tuple[str, ...]:
    """The shipped real words, distinct and sorted (common-words extraction draws from these first)."""
    return tuple(sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS)))


def distinct_words(rng: np.random.Generator, n: int) -> list[str]:
    """`n` distinct words in random order: real words while they last, then pseudo-words."""
    real = english_words()
    if n <= len(real):
        return [real[i] for i in rng.choice(len(real), size=n, replace=False)]
    taken = set(real)
    words = list(real) + [w for w in pseudo_words(rng, n) if w not in taken][:n - len(real)]
    while len(words) < n:  # a pseudo-word that happened to be a real one: draw more
        taken = set(words)
        words += [w for w in pseudo_words(rng, n - len(words)) if w not in taken]
    return [words[i] for i in rng.permutation(n)]


def random_key(rng: np.random.Generator) -> str:
    """An "adjective-noun" key, as RULER's words needles ("bitter-falcon")."""
    return f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"


def random_number(rng: np.random.Generator, digits: int = 7) -> str:
    """A number of exactly `digits` digits, uniform (RULER's generate_random_number)."""
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def random_uuid(rng: np.random.Generator) -> str:
    """A version-4 UUID from 128 random bits (RULER's generate_random_uuid)."""
    bits = int.from_bytes(rng.bytes(16), "big")
    return str(uuid.UUID(int=bits, version=4))


NEEDLE_TYPES = {"words": random_key, "numbers": random_number, "uuids": random_uuid}


def draw_distinct(rng: np.random.Generator, kind: str, n: int, avoid: set[str] = frozenset()) -> list[str]:
    """`n` distinct draws of needle type `kind` ("words", "numbers", "uuids"), none in `avoid`."""
    make, out = NEEDLE_TYPES[kind], []
    seen = set(avoid)
    while len(out) < n:
        value = make(rng)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out
