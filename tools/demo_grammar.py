"""The language of Folio's demo model: vocabulary, filler grammar, fact/question formats.

This module is the single source of truth for the synthetic data of `tools/train_demo.py`.
It builds two artefacts that ship with the model:

* `tokenizer.json`  -- a word-level tokenizer (`tokenizers` WordLevel model, lowercase
  normalizer, whitespace + punctuation + single-digit pre-tokenizers), loadable by the Rust
  `tokenizers` crate.
* `eval_spec.json`  -- everything a program needs to generate prompts of the training
  distribution without Python (see docs/demo-model.md, "eval_spec.json").

Pure Python + `tokenizers`; no torch here, so it can be tested on any machine.
"""

from __future__ import annotations

import json

# --------------------------------------------------------------------------------------
# Special tokens (ids 0..8 in this order)
# --------------------------------------------------------------------------------------
BOS, EOS, UNK, PAD = "<|bos|>", "<|eos|>", "<|unk|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END, DOC = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|doc|>"
SPECIALS = [BOS, EOS, UNK, PAD, SYSTEM, USER, ASSISTANT, END, DOC]

DIGITS = list("0123456789")
# Every ASCII punctuation character is its own token (the Punctuation pre-tokenizer isolates them).
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
LETTERS = list("abcdefghijklmnopqrstuvwxyz")

# --------------------------------------------------------------------------------------
# Key words: keys are "{key_adj} {key_noun}" (e.g. "amber falcon"). Disjoint from filler.
# --------------------------------------------------------------------------------------
KEY_ADJS = """amber azure bronze cobalt copper coral crimson cyan ebony emerald golden indigo ivory
jade lavender lilac magenta maroon ochre olive onyx opal pearl pink purple ruby saffron sapphire
scarlet silver slate teal topaz turquoise umber violet white black blue green red yellow orange
gray brown crystal marble velvet""".split()

KEY_NOUNS = """falcon tiger otter heron badger beaver bison camel cobra condor coyote crane crow
deer dolphin eagle ferret finch fox gazelle gecko goose hare hawk hedgehog hyena ibis jackal
jaguar koala lemur leopard lion lizard llama lynx marmot mink moose moth newt ocelot owl panda
panther parrot pelican penguin puma rabbit raven salmon seal shark sparrow spider squid swan
toad turtle walrus weasel whale wolf wombat yak zebra""".split()

# Relations of key-value facts: "the {relation} of {key} is {value} ."
RELATIONS = ["secret code", "access code", "room number", "lucky number"]
# Variable names for variable tracking ("the value of q is ..."): single letters, not "a"/"i".
VARIABLES = [c for c in LETTERS if c not in ("a", "i")]

# --------------------------------------------------------------------------------------
# Filler grammar. Slots are written {name}; each occurrence is filled independently.
# --------------------------------------------------------------------------------------
FILLER_SLOTS: dict[str, list[str]] = {
    "adj": """quiet ancient narrow busy gentle heavy bright dusty empty famous fragile hidden hollow
humble large little lonely modest noisy old pale plain proud rapid rough round rusty sharp short
simple small smooth soft solid steep strange strong sturdy sudden tall tender thin tidy tiny warm
weary wet wide wild wise wooden young calm clever cold curious distant dry early eager faint
fierce fresh grand happy honest kind late loud merry mild neat patient polite rare ripe shy
silent sleepy slow sour sweet swift bitter broken careful cheerful clean crowded dark deep
dull elegant fancy flat foggy gloomy graceful hungry icy lazy lively lovely misty muddy narrow
nervous peaceful pleasant rainy restless rich rocky salty sandy shiny snowy sunny thick useful
windy worn""".split(),
    "noun": """lantern basket bridge candle kettle ladder letter mirror needle paddle pencil pillow
ribbon saddle shovel signal statue tower wagon window anchor barrel blanket bottle bucket cabin
carpet chair chimney clock cloud coat compass cottage cup desk door drum engine fence field flag
flower fountain gate glove hammer hat helmet hill island jacket lake lamp leaf map mountain nail
net notebook oven painting path piano plate pond pot rope road roof sail scarf shelf ship shoe
spoon stair stone stove street table tent ticket tool towel train tree trumpet tunnel umbrella
vase violin wall wheel whistle windmill book box brush button cart chest coin crate curtain
feather fork gift jar kite knife ladle mug oar parcel pipe quilt ring rug sack scroll sled
spade sword teapot thread torch tray trunk vest wallet wire""".split(),
    "plural": """apples books boxes coins crates eggs feathers lamps letters maps nails pears
plates ropes shells stones tickets tools cups bottles candles baskets blankets buttons carrots
chairs flowers jars leaves loaves onions papers pencils potatoes ribbons scarves spoons tables
wheels barrels bells keys brushes""".split(),
    "place": """market harbor village station library bakery school museum theater temple square
garden orchard valley forest river castle farm workshop kitchen cellar attic meadow pier mill
inn church hospital factory office port quarry camp canal bazaar courtyard lighthouse monastery
observatory palace plaza shipyard stable tavern vineyard warehouse""".split(),
    "name": """anna marco lena oskar nina tomas clara felix ida hugo mira paul rosa leon sara emil
vera jonas lisa otto greta karl elsa max julia adam eva noah maya ben lucas sofia ella theo ruth
ivan olga peter hanna victor""".split(),
    "verb_t": """carried found painted repaired opened closed cleaned moved lifted dropped borrowed
bought sold packed counted measured mended polished watched visited crossed climbed followed
passed built drew fixed folded guarded hid kept lost noticed ordered pulled pushed raised carved
checked delivered filled gathered held loaded marked planted rolled sorted studied tied wrapped
washed""".split(),
    "verb_i": """slept waited rested laughed smiled wandered sang danced worked listened paused
arrived left returned stayed walked hurried whispered shouted nodded sighed waved sat stood ran
jumped trembled glowed faded shone""".split(),
    "adverb": """slowly quietly quickly carefully gently loudly happily briefly calmly eagerly firmly
gladly kindly lazily neatly nervously openly patiently politely proudly rarely roughly sadly
safely softly silently simply suddenly warmly wisely often again later once""".split(),
    "prep": """near behind beside under above inside across along toward past below beyond""".split(),
    "time": [
        "in the morning", "in the evening", "at dawn", "at noon", "at night", "before the rain",
        "after the storm", "during the festival", "on monday", "on tuesday", "on wednesday",
        "on thursday", "on friday", "on saturday", "on sunday", "in winter", "in summer",
        "in spring", "in autumn", "last week", "the next day", "every year", "for an hour",
        "after dinner", "before sunrise", "at midnight",
    ],
}
# Dedup while keeping order (a word may be listed twice by accident).
for _k, _v in FILLER_SLOTS.items():
    FILLER_SLOTS[_k] = list(dict.fromkeys(_v))

# Integer slots: {num} is an integer whose decimal digit count is uniform in [min, max]
# (no leading zero), e.g. 7, 42, 815, 2024.
NUMBER_SLOTS = {"num": {"digits_min": 1, "digits_max": 4}}

FILLER_TEMPLATES = [
    "the {adj} {noun} was {prep} the {noun} .",
    "{name} {verb_t} the {adj} {noun} {time} .",
    "{time} , {name} {verb_i} {prep} the {place} .",
    "a {adj} {noun} stood {prep} the {place} .",
    "{name} and {name} {verb_t} a {noun} {prep} the {place} .",
    "there were {num} {plural} in the {place} .",
    "the {noun} in the {place} was {adj} and {adj} .",
    "{name} {verb_i} {adverb} while the {noun} {verb_i} .",
    "nobody {verb_t} the {noun} {time} .",
    "{name} said that the {noun} was very {adj} .",
    "we {verb_t} {num} {plural} {prep} the {noun} .",
    "the {place} was {adj} {time} .",
    "{adverb} , the {adj} {noun} {verb_i} .",
    "{name} {verb_t} the {noun} and then {verb_i} .",
    "it was a {adj} day in the {place} .",
    "the road to the {place} was {adj} .",
    "{name} kept a {adj} {noun} {prep} the {noun} .",
    "many {plural} {verb_i} {prep} the {place} {time} .",
    "the {noun} of the {place} {verb_i} {adverb} .",
    "{name} asked {name} about the {adj} {noun} .",
    "the old map showed a {noun} {prep} the {place} .",
    "{name} wrote {num} letters about the {place} .",
    "every {noun} in the {place} was {adj} .",
    "the weather was {adj} and the {plural} were {adj} .",
    "{name} {verb_i} for {num} minutes .",
    "a {adj} wind moved the {noun} {prep} the {place} .",
    "the {noun} was {adj} , but the {noun} was {adj} .",
    "{name} found {num} {plural} {prep} the {noun} .",
    "people in the {place} {verb_t} the {noun} {adverb} .",
    "the story of the {adj} {noun} is {adj} .",
    "nobody knew why the {noun} was so {adj} .",
    "{name} {verb_t} {num} {plural} and gave them to {name} .",
    "if the {noun} is {adj} , {name} will be {adj} .",
    "the children {verb_i} {prep} the {adj} {noun} .",
    "from the {place} one could see the {adj} {noun} .",
    "record {num} : {name} , age {num} , from the {place} .",
    "item {num} : {num} {plural} , {adj} , stored in the {place} .",
    "order {num} : {name} bought {num} {plural} for {num} coins .",
    "entry {num} : the {noun} weighs {num} kilograms .",
    "report {num} : the {place} had {num} visitors {time} .",
    "list {num} : {noun} , {noun} , {noun} and {noun} .",
]

TITLE_TEMPLATES = [
    "notes on the {adj} {noun}",
    "the {place} report",
    "letters from the {place}",
    "a story about {name}",
    "records of the {place}",
    "the diary of {name}",
    "field notes from the {place}",
    "the {adj} {place}",
]

# --------------------------------------------------------------------------------------
# Planted facts, questions and answers. The answer repeats the fact's words, so the
# value is a pure copy of what followed the same words in the documents.
# --------------------------------------------------------------------------------------
KV_FACT = "the {relation} of {key} is {value} ."
KV_QUESTION = "what is the {relation} of {key} ?"
KV_ANSWER = "the {relation} of {key} is {value} ."
KV_ANSWER_PREFIX = "the {relation} of {key} is"

PASSKEY_FACT = "the pass key is {value} ."
PASSKEY_QUESTION = "what is the pass key ?"
PASSKEY_ANSWER = "the pass key is {value} ."
PASSKEY_ANSWER_PREFIX = "the pass key is"

VAR_FACT = "the value of {var} is {value} ."
VAR_LINK = "the value of {var} is the value of {source} ."
VAR_QUESTION = "what is the value of {var} ?"
# The answer walks the chain: one VAR_LINK per hop (from the asked variable down), then VAR_FACT.

PAIR_QUESTION = "what is the {relation} of {key} and the {relation2} of {key2} ?"
# Answer: KV_ANSWER for the first key, a space, KV_ANSWER for the second key.

DOC_HEADER = "<|doc|> title : {title} ."

# Value format of planted facts: random decimal digits (leading zeros allowed), written
# without spaces ("48152"); each digit is one token. Eval uses EVAL_VALUE_DIGITS; training
# draws the digit count per RECIPES below.
EVAL_VALUE_DIGITS = 5

# Words that replace the {num} filler slot when a recipe keeps digits out of the filler. All of
# them are already in the vocabulary (so the tokenizer is the same for every recipe).
NUM_WORDS = ["one", "many", "more", "no", "all", "both", "each", "first", "second", "third", "last", "next"]

# --------------------------------------------------------------------------------------
# Training recipes (docs/demo-model.md has the runs and their figures). A recipe fixes the
# data distribution; eval_spec(recipe) describes it for prompt generators.
#   value_digits:    (min, max) digits of planted values, uniform
#   filler_numbers:  True: {num} is a 1-4 digit integer; False: a word from NUM_WORDS, so the
#                    only digit runs in a sequence are planted values
#   pose:            "random_cuts": 1-2 random cuts, gaps summing to a log-uniform max position
#                    (run 1); "fact_distance": one skip between the asked fact and the question
#                    so the fact-question distance in position ids is log-uniform in
#                    [100, max_position_embeddings - L], plus a uniform skip before the fact
#                    half of the time (run 3)
#   prefill_answer_prefix: the eval mode eval_spec.json recommends (chat.prefill_answer_prefix).
#                    Runs 1 and 3: prefilling changed no needle answer (run 1: 100/100 samples
#                    at 32k and 128k identical), so they say false. Runs 5 and 6 say true: at 1M
#                    ftD (run 5) scored 9/10 prefilled, 7/10 generated; ftE (run 6) 9/10, 6/10.
#                    Training data does not depend on it (run 5's stage log, written before
#                    the measurement, still says false).
#   decoys:          training-only hard negatives aimed at run 1's failure at 512k-1M (the value's
#                    digits drift once a long filler holds many digit runs that share a few digits
#                    with it): other facts' values and extra filler records whose numbers share a
#                    run of >= 2 digits with a planted value, so that continuing a copy from the last
#                    digits alone is wrong already at 4k tokens. The prompt distribution is
#                    unchanged (eval_spec.json differs only by the recipe's other settings).
#   passkey_among_facts: pass-key sequences also hold 0-7 key-value facts (training only).
# Runs 3, 4 and 5 from scratch did not train (they copy a distractor's value: docs/demo-model.md);
# the shipped model is run 1 fine-tuned on longer sequences, then on run 5's data, then on run 6's
# at 16k-32k tokens.
# --------------------------------------------------------------------------------------
RECIPES = {
    "run1": {"value_digits": (4, 6), "filler_numbers": True, "pose": "random_cuts",
             "prefill_answer_prefix": False, "decoys": False},
    "run3": {"value_digits": (5, 5), "filler_numbers": False, "pose": "fact_distance",
             "prefill_answer_prefix": False, "decoys": False},
    "run4": {"value_digits": (4, 6), "filler_numbers": True, "pose": "random_cuts",
             "prefill_answer_prefix": False, "decoys": True},
    "run5": {"value_digits": (5, 5), "filler_numbers": True, "pose": "random_cuts",
             "prefill_answer_prefix": True, "decoys": True},
    # run 5 with other facts beside the pass key (ftD missed the pass key of assets/samples,
    # whose files hold seven other facts); the shipped model's last stage (ftE)
    "run6": {"value_digits": (5, 5), "filler_numbers": True, "pose": "random_cuts",
             "prefill_answer_prefix": True, "decoys": True, "passkey_among_facts": True},
}
for _r in RECIPES.values():
    _r.setdefault("passkey_among_facts", False)
# decoys: share of sequences with decoy records, and their count (max_decoys)
DECOY_SEQUENCE_SHARE = 0.6
DECOY_TOKENS_PER = 256


def max_decoys(length: int) -> int:
    """Most decoy records in a training sequence of `length` tokens (uniform in 1 ..)."""
    return max(2, length // DECOY_TOKENS_PER)
# share of multi-fact sequences whose other values share a digit run with the asked one
DECOY_VALUE_SHARE = 0.5
DEFAULT_RECIPE = "run1"  # train_demo.py's default: the first stage of the shipped model
# The shipped model's last stage (tools/train_demo_shipped.sh); assets/models/demo/eval_spec.json
# is eval_spec(SHIPPED_RECIPE).
SHIPPED_RECIPE = "run6"
POSE_MIN_DISTANCE = 100

# Extra words used only by the fixed parts above (questions, headers, facts) and samples.
FUNCTION_WORDS = """the a an of is was were what and or but then to in on at for from with by
about that this it its be will one could see so very why knew if them gave there we people
children nobody every many pass key value secret code access room lucky number title stood
showed old map road weather day wind moved minutes story age stored bought coins weighs
kilograms had visitors wrote letters list report record item order entry notes on diary field
records question answer remember found is are has have not no yes who where when which how
please tell me""".split()

# Words that a user of the demo may type; kept in the vocabulary so samples read naturally.
EXTRA_WORDS = """document documents file files notes note page pages chapter section code codes
numbers values keys text hello thanks thank you ok okay also both all each other first second
third last next new more less most least than as my your our their his her he she they i us
him do does did can may might must should would shall here now today tomorrow yesterday
morning evening night week month year years""".split()


def vocabulary() -> list[str]:
    """The ordered vocabulary: specials, digits, punctuation, letters, then words."""
    words: list[str] = []
    for group in (
        list(FILLER_SLOTS.values())
        + [[w for phrase in FILLER_SLOTS["time"] for w in phrase.split()]]
        + [KEY_ADJS, KEY_NOUNS, [w for r in RELATIONS for w in r.split()]]
        + [FUNCTION_WORDS, EXTRA_WORDS]
    ):
        for phrase in group:
            words.extend(phrase.split())
    for t in FILLER_TEMPLATES + TITLE_TEMPLATES + [KV_FACT, PASSKEY_FACT, VAR_LINK, PAIR_QUESTION, DOC_HEADER]:
        for w in t.split():
            if not (w.startswith("{") or w.startswith("<|")):
                words.append(w)
    base = SPECIALS + DIGITS + PUNCT + LETTERS
    seen = set(base)
    out = list(base)
    for w in words:
        if w not in seen:
            assert w.isalpha() and w.islower(), w
            seen.add(w)
            out.append(w)
    return out


def check_disjoint() -> None:
    filler = set()
    for k, v in FILLER_SLOTS.items():
        for p in v:
            filler.update(p.split())
    for t in FILLER_TEMPLATES + TITLE_TEMPLATES:
        filler.update(w for w in t.split() if not w.startswith("{"))
    keys = set(KEY_ADJS) | set(KEY_NOUNS)
    clash = filler & keys
    assert not clash, f"key words also in filler: {sorted(clash)}"
    rel = {w for r in RELATIONS for w in r.split()} | {"pass", "key", "value"}
    clash = filler & rel
    assert not clash, f"relation words also in filler: {sorted(clash)}"
    assert len(set(KEY_ADJS)) == len(KEY_ADJS) and len(set(KEY_NOUNS)) == len(KEY_NOUNS)
    vocab = set(vocabulary())
    assert all(w in vocab and w.isalpha() for w in NUM_WORDS), "NUM_WORDS must be vocabulary words"
    assert not (set(NUM_WORDS) & (keys | rel)), "NUM_WORDS clash with key or relation words"


def tokenizer_json(vocab: list[str]) -> dict:
    """A plain `tokenizers` JSON: WordLevel + Lowercase + (WhitespaceSplit, Punctuation, Digits)."""
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(SPECIALS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "WhitespaceSplit"},
                {"type": "Punctuation", "behavior": "Isolated"},
                {"type": "Digits", "individual_digits": True},
            ],
        },
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(vocab)}, "unk_token": UNK},
    }


def build_tokenizer(vocab: list[str]):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(tokenizer_json(vocab)))


# The chat template (HF semantics: rendered with bos_token, messages, add_generation_prompt).
# Whitespace around special tokens does not matter to the tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} <|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool) -> str:
    """Python twin of CHAT_TEMPLATE (tests check they agree with jinja2)."""
    s = BOS
    for m in messages:
        assert m["role"] in ("system", "user", "assistant"), m["role"]
        s += f"<|{m['role']}|> {m['content']} <|end|>\n"
    if add_generation_prompt:
        s += "<|assistant|> "
    return s


def filler_spec(recipe: str = DEFAULT_RECIPE) -> dict:
    r = RECIPES[recipe]
    if r["filler_numbers"]:
        return {"templates": FILLER_TEMPLATES, "slots": FILLER_SLOTS, "number_slots": NUMBER_SLOTS}
    return {"templates": FILLER_TEMPLATES, "slots": {**FILLER_SLOTS, "num": NUM_WORDS}, "number_slots": {}}


def eval_spec(recipe: str = DEFAULT_RECIPE) -> dict:
    """The machine-readable description of the prompt distribution (eval_spec.json)."""
    r = RECIPES[recipe]
    return {
        "format": "folio-demo-eval-spec",
        "version": 1,
        "description": (
            "Prompt distribution of Folio's demo model. Generate documents of filler sentences "
            "with planted facts, ask about one fact, expect the answer format below. "
            "See docs/demo-model.md for the exact algorithm."
        ),
        "tokenizer": "tokenizer.json",
        "chat": {
            "template": "chat_template.jinja",
            "documents_role": "system",
            "question_role": "user",
            "documents_in_user_also_trained": True,
            "documents_in_user_separator": "\n",
            "add_generation_prompt": True,
            "prefill_answer_prefix": r["prefill_answer_prefix"],
            "stop_tokens": [END, EOS],
        },
        "document": {
            "header": DOC_HEADER,
            "title_templates": TITLE_TEMPLATES,
            "sentence_separator": " ",
            "header_separator": "\n",
            "document_separator": "\n",
        },
        "filler": filler_spec(recipe),
        "keys": {"format": "{adj} {noun}", "adjectives": KEY_ADJS, "nouns": KEY_NOUNS},
        "value": {"digits": EVAL_VALUE_DIGITS, "train_digits": list(r["value_digits"]),
                  "alphabet": "0123456789", "leading_zero_allowed": True},
        "tasks": {
            "needle": {
                "fact": KV_FACT,
                "relations": RELATIONS,
                "question": KV_QUESTION,
                "answer": KV_ANSWER,
                "answer_prefix": KV_ANSWER_PREFIX,
                "distractors": 3,
                "documents": 3,
                "distinct_keys": True,
            },
            "passkey": {
                "fact": PASSKEY_FACT,
                "question": PASSKEY_QUESTION,
                "answer": PASSKEY_ANSWER,
                "answer_prefix": PASSKEY_ANSWER_PREFIX,
                "distractors": 0,
                "documents": 1,
            },
            "variable_tracking": {
                "fact": VAR_FACT,
                "link": VAR_LINK,
                "variables": VARIABLES,
                "question": VAR_QUESTION,
                "answer": "one link per hop from the asked variable down, then the fact, joined by ' '",
                "answer_prefix": "the value of {var0} is",
                "hops": 2,
                "distractors": 2,
                "documents": 1,
            },
            "multi_doc": {
                "fact": KV_FACT,
                "relations": RELATIONS,
                "question": PAIR_QUESTION,
                "answer": "{answer1} {answer2}",
                "distractors": 2,
                "documents": 3,
                "facts_in_different_documents": True,
            },
        },
        "check": {
            "value_match": (
                "decode the generated ids up to the first stop token, skipping special tokens; "
                "find the last occurrence of the answer prefix; take the characters after it up "
                "to the next '.'; remove spaces; it must equal the value"
            ),
            "exact_match": "the generated ids before the stop token equal the tokenized answer",
            "prefilled": (
                "when chat.prefill_answer_prefix is true, the prompt is the rendered chat (with the "
                "generation prompt) followed by the answer prefix, e.g. '... <|assistant|> the secret "
                "code of amber falcon is', and its token count, prefix included, is at most the "
                "length; the model only generates the value: the generated text up to the next '.', "
                "spaces removed, must equal the value. When false, the model generates the whole "
                "answer and value_match applies"
            ),
        },
        "eval_defaults": {"lengths": [2048, 8192, 32768, 131072], "depths": [0, 0.25, 0.5, 0.75, 1.0],
                          "samples": 10, "task": "needle"},
    }
