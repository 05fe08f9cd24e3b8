"""What agents need from a model's output, each a standalone module (issue 24):

- `toolcalls`  the checkpoint's tool-call tokens -> OpenAI `tool_calls`, complete and streamed
- `reasoning`  thinking sections -> `reasoning_content`, complete and streamed
- `markers`    marker strings found in text that arrives in pieces (used by the two above)
- `grammar`    `response_format` (json_object, json_schema) as a next-token mask, over llguidance
- `toolgrammar` tool_choice required / named as a grammar of the checkpoint's tool-call section
- `vocab`      every token id's bytes (what the grammar engine needs)
- `logprobs`   logprobs in OpenAI's chat / completions / echo shapes
- `penalties`  frequency, presence and repetition penalties, min_p, logit_bias on a batch of rows

The last pipeline stage uses penalties, grammar and logprobs where it samples; the API uses the parsers and
formats the logprobs. Nothing here imports the API, the node or the transport.
"""
