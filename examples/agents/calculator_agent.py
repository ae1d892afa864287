"""An agent in OpenAI's tool-calling style, as any harness writes one: it sends the conversation
with the tools' schemas, runs the calls the model makes, sends their results back as ``tool``
messages, and stops at a reply that calls nothing. tba gives it a client of the searcher's
endpoint for each rollout (``task.agent``, docs/agents.md) and trains on the tokens the endpoint
generated for it. ``tba train configs/agent.yaml`` runs it on the tool demo's model."""

import json

from transformers.utils import get_json_schema

from tba.tasks.calculator import calculator

TOOLS = [get_json_schema(calculator)]


def calculator_agent(prompt, client, system=None):
    """OpenAI tool calling: the model's calls run here, their results go back as tool messages,
    until a reply calls nothing. None: the task scores the last reply."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt.text}]
    while True:
        message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # the model's call was wrong: it is told so
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
