"""Chat templates for the tiny tokenizer in the OpenAI tests (unit and integration): ChatML, and a Hermes-style
one with tools (what SmolLM2-Instruct and Qwen templates teach), short for a tiny model."""

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# each tool as name(parameters) in a system turn, calls as <tool_call> blocks (Hermes' format)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | list | join(',') }}){% endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{%- for c in m['tool_calls'] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
