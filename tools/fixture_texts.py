"""The texts of the test fixtures (tools/make_fixtures.py): a small training corpus written for
this project, the evaluation texts whose logits and perplexity the fixtures record, and the chat
templates and messages each family's cases render. Data only, apart from the corpus builder.
"""

import random

# ---------------------------------------------------------------------------
# Training corpus (written for this project) and evaluation texts.
# ---------------------------------------------------------------------------

CORPUS_PARAGRAPHS = [
    "The harbour town woke slowly on winter mornings. Fishermen carried their "
    "nets down to the boats while the bakers opened their shutters and the smell "
    "of warm bread drifted along the narrow streets. Children ran to school with "
    "their coats buttoned to the chin, and the old church bell rang seven times.",

    "A good recipe is a small story about patience. First you gather the "
    "ingredients: flour, water, salt and a little yeast. Then you mix them, knead "
    "the dough for ten minutes, and leave it to rest in a warm place. After an hour "
    "the dough has doubled in size, and it is ready to be shaped and baked.",

    "Computers follow instructions exactly as they are written. A program is a list "
    "of such instructions, and a bug is usually a place where the instructions say "
    "something different from what the programmer meant. Testing helps us find "
    "those places before our users do. Good tests are small, fast and repeatable.",

    "The river begins high in the mountains as melted snow. It gathers strength "
    "from hundreds of small streams, cuts a valley through the forest, and finally "
    "reaches the plain, where it slows down and winds between fields of wheat and "
    "corn before it meets the sea.",

    "What is the capital of France? The capital of France is Paris. What is the "
    "capital of Italy? The capital of Italy is Rome. Berlin is the capital of "
    "Germany, Madrid is the capital of Spain, and London is the capital of the "
    "United Kingdom. Each of these cities has a long and complicated history.",

    "You are a helpful assistant. When someone asks you a question, answer it "
    "clearly and honestly. If you do not know the answer, say so. Keep your answers "
    "short unless the user asks for more detail, and always be polite.",

    "The user asked the assistant to explain how a rainbow forms. The assistant "
    "said that sunlight is made of many colours, and that each raindrop bends and "
    "reflects the light. Because every colour bends by a slightly different angle, "
    "the colours separate and we see a bright arc across the sky.",

    "In the spring the garden is full of work. The soil must be turned, the weeds "
    "pulled, and the seeds planted in straight rows. Tomatoes need sun and water, "
    "beans need something to climb, and the lettuce grows best in the cool shade "
    "near the wall. By summer the garden feeds the whole family.",

    "The library was quiet except for the ticking of the clock above the door. A "
    "student sat at the long wooden table, reading about the history of ships and "
    "sailors. She wrote notes in a small book: the first boats were made of reeds, "
    "later ships had sails, and modern ships use powerful engines.",

    "Numbers appear everywhere in daily life. There are 7 days in a week, 12 months "
    "in a year, 24 hours in a day and 60 minutes in an hour. A train that leaves at "
    "9:15 and arrives at 11:45 has travelled for two and a half hours. If it moved "
    "at 80 kilometres per hour, it covered 200 kilometres.",

    "Music can change the feeling of a room. A slow song on the piano makes people "
    "calm and thoughtful, while a fast rhythm on the drums makes them want to dance. "
    "Many people learn to play an instrument as children and keep playing for the "
    "rest of their lives, simply because it makes them happy.",

    "The weather today will be cloudy in the morning with light rain in the north. "
    "In the afternoon the clouds will clear and the temperature will rise to "
    "eighteen degrees. Tonight will be cold and dry, with a gentle wind from the "
    "west and a chance of fog near the coast.",

    "Think step by step. First read the question carefully. Then decide what "
    "information you need, find it, and check that it is correct. Finally write "
    "the answer in a clear sentence. This simple method works for school "
    "exercises, for puzzles, and for many problems at work.",

    "The cat slept on the windowsill all afternoon, waking only when a bird landed "
    "on the branch outside. It watched the bird with great interest, its tail "
    "moving slowly from side to side, but it did not jump. When the bird flew away, "
    "the cat yawned, stretched, and went back to sleep.",

    "A map is a picture of a place seen from above. It shows roads, rivers, hills "
    "and towns, and it uses a scale so that we can measure distances. With a map and "
    "a compass, a careful walker can cross a wide forest without getting lost, even "
    "when the path disappears under the leaves.",

    "Good software is built in small steps. Write a little code, run it, and look "
    "at the result. When something breaks, read the error message slowly; it "
    "usually tells you exactly where the problem is. Keep your functions short, "
    "give your variables clear names, and write comments that explain why.",

    "The market square was busy on Saturday. Farmers sold apples, pears, cheese "
    "and honey from their stalls, and a man with a violin played old songs near the "
    "fountain. People stopped to talk with their neighbours, and the children "
    "counted their coins to buy sweets.",

    "Light travels very fast, about three hundred thousand kilometres every "
    "second. Even so, light from the sun needs about eight minutes to reach the "
    "earth, and light from the nearest stars needs several years. When we look at "
    "the night sky, we see the stars as they were long ago.",

    "Dear friend, thank you for your kind letter. We are all well here, and the "
    "new house is finally finished. The kitchen is bright, the garden is large, and "
    "there is a small room for guests. Please come and visit us in the summer; "
    "we would be very happy to see you again.",

    "Questions and answers help people learn. Why is the sky blue? Because air "
    "scatters blue light more than red light. Why do leaves fall in autumn? "
    "Because the trees stop feeding them to save water for the winter. How do "
    "birds find their way? They use the sun, the stars and the earth itself.",
]

_SUBJECTS = [
    "the teacher", "a young doctor", "my neighbour", "the small dog", "our team",
    "the old captain", "a curious child", "the engineer", "her brother",
    "the farmer", "a tired traveller", "the little robot", "the writer",
    "their grandmother", "the new student", "a quiet musician",
]
_VERBS = [
    "found", "carried", "painted", "repaired", "explained", "opened", "watched",
    "cleaned", "described", "planted", "followed", "counted", "visited",
    "remembered", "measured", "built", "shared", "studied",
]
_OBJECTS = [
    "a wooden box", "the broken clock", "a long letter", "the green door",
    "an old photograph", "the kitchen table", "a basket of apples",
    "the map of the city", "a strange noise", "the empty house",
    "a bright red kite", "the last train", "a simple question", "the river bank",
    "a cup of tea", "the garden gate",
]
_PLACES = [
    "near the station", "after lunch", "in the morning", "before the storm",
    "at the end of the street", "during the holiday", "behind the school",
    "on a rainy evening", "in the village", "after many years", "by the sea",
    "under the bridge",
]
_ENDINGS = [
    "and everyone smiled.", "but nobody noticed.", "because it was important.",
    "so the day felt longer.", "while the rain kept falling.",
    "and then went home.", "without saying a word.", "as the sun went down.",
]


def build_corpus():
    """Handwritten paragraphs plus deterministic generated sentences."""
    rng = random.Random(1234)
    lines = list(CORPUS_PARAGRAPHS)
    for _ in range(260):
        s = "%s %s %s %s %s" % (
            rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS),
            rng.choice(_PLACES), rng.choice(_ENDINGS))
        lines.append(s[0].upper() + s[1:])
    # A few chat-formatted lines so the special-token neighbourhood is trained.
    for q, a in [
        ("What is the capital of France?", "The capital of France is Paris."),
        ("How many days are in a week?", "There are seven days in a week."),
        ("Can you help me with my homework?", "Of course, what is the question?"),
    ]:
        lines.append("system\nYou are a helpful assistant.\nuser\n%s\nassistant\n%s" % (q, a))
    return lines


LOGITS_TEXT = ("The old captain carried a basket of apples to the market "
               "while the children laughed at the robot.")

PPL_TEXT = (
    "On the first warm day of the year, the whole village walked down to the lake. "
    "Some people brought baskets of bread and cheese, others carried chairs and "
    "blankets, and a few of the older children pushed a small boat into the water. "
    "The teacher explained to the younger ones why the ice had melted so quickly: "
    "the sun was higher in the sky, the days were longer, and the wind came from the "
    "south. By the evening everyone was tired and happy, and they walked home "
    "under a sky full of stars.\n"
)

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]

# ---------------------------------------------------------------------------
# Chat templates (written for this project).
# ---------------------------------------------------------------------------

LLAMA_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim }}\n"
    "    {{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

QWEN2_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

QWEN3_TEMPLATE = r"""{%- set thinking = enable_thinking if enable_thinking is defined else true %}
{%- set ns = namespace(last_query=-1, n_system=0) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages | length - 1) - loop.index0 %}
    {%- if ns.last_query == -1 and message.role == 'user' and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content.strip() + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call these functions:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content.strip() + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {%- set ns.n_system = ns.n_system + 1 %}
            {{- '<|im_start|>system\n' + message.content.strip() + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}
            {%- set content = content.split('</think>')[-1].lstrip() %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if not thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

# Extra template cases recorded in reference.json["chat_cases"].
EXTRA_CHAT_CASES = {
    "llama": [
        {"messages": [
            {"role": "user", "content": "  Hello there!  \n"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Tell me a joke."}],
         "add_generation_prompt": True},
        {"messages": [{"role": "user", "content": "No prompt please."}],
         "add_generation_prompt": False},
    ],
    "qwen2": [
        {"messages": [{"role": "user", "content": "Hello!"}],
         "add_generation_prompt": True},
        {"messages": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "What is two plus two?"}],
         "add_generation_prompt": True},
    ],
    "qwen3": [
        {"messages": [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\nFour."},
            {"role": "user", "content": "And three plus three?"},
            {"role": "assistant", "content": "<think>Easy: six.</think>  Six."}],
         "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "Hello!"}],
         "add_generation_prompt": True, "enable_thinking": False},
        {"messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}],
         "add_generation_prompt": True,
         "tools": [{"type": "function", "function": {
             "name": "get_weather", "description": "Get the weather for a city, e.g. \"Paris\".",
             "parameters": {"type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}}]},
    ],
    "mistral": [
        {"messages": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "Tell me a joke."}],
         "add_generation_prompt": True},
    ],
}

MISTRAL_BAD_MESSAGES = [
    {"role": "user", "content": "Hello!"},
    {"role": "user", "content": "Are you there?"},
]

# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------
