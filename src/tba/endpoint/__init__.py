"""An OpenAI-compatible endpoint to a searcher's policy, and conversations that an agent drives
through it.

A searcher whose task names an agent (``task.agent``) serves ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` on 127.0.0.1 while the run trains
(:class:`~tba.endpoint.server.Endpoint`). For each rollout it opens, the agent gets a client whose
base URL carries the rollout's id (``/rollouts/<id>/v1``; a request may name one in its body as
``rollout_id`` instead). The searcher assembles the rollout's trajectory from exactly the tokens
it generated for those requests (:class:`~tba.endpoint.book.RolloutBook`), with the same
:class:`~tba.generation.turns.Conversation` as an environment's conversations: the messages the
agent adds between replies are rendered by the chat template and marked 0. Like vLLM's server,
a choice carries its token ids and log-probs when asked (``return_token_ids``, ``logprobs``).
"""
