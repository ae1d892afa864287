"""Chat templates that render tools, and a tokenizer that uses one."""

from __future__ import annotations

from tba.models.tiny import build_char_tokenizer

# Two chat templates written for these tests, each rendering the tools' JSON schemas the way its
# family does and writing calls in its family's format.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>user<|end_header_id|>\nAnswer with a JSON function call "
    '{"name": function name, "parameters": arguments}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}'
    "<|eot_id|>{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|start_header_id|>ipython"
    "<|end_header_id|>\n{{ m.content }}<|eot_id|>{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n"
    "{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}"
)


def chat_tokenizer(template: str):
    """The demo's character tokenizer with ``template`` as its chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    return tokenizer
