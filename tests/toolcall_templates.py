"""Chat templates for the tool-call tests, written here after the formats their families publish (the
published templates themselves could not be copied into this repository: they come from the Hugging Face
hub, which these machines do not reach). Each keeps the parts of its family's template that decide how
tools, calls and results are written; the sources they follow:

- JSON_TEMPLATE: Qwen2.5 / Qwen3 / Hermes 2 Pro (tokenizer_config.json of Qwen/Qwen2.5-7B-Instruct and
  NousResearch/Hermes-2-Pro): tools inside <tools></tools>, calls as <tool_call>\\n{"name", "arguments"}
  \\n</tool_call>, results inside <tool_response></tool_response> in a user turn; arguments as an object or
  a string (`is string`); <think> reasoning opened by the generation prompt when enable_thinking (Qwen3).
- DEEPSEEK_TEMPLATE: DeepSeek-V3 (tokenizer_config.json of deepseek-ai/DeepSeek-V3-0324): calls as
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
  <｜tool▁calls▁end｜>, the arguments concatenated as a string, results as <｜tool▁output▁begin｜>.
- LLAMA3_TEMPLATE: Llama 3.1 JSON tool calling (meta-llama/Llama-3.1-8B-Instruct): the tools as JSON in the
  user turn, a call as {"name": ..., "parameters": ...}, results in an "ipython" turn, <|python_tag|>.
"""

JSON_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}{% if (loop.first and message.content) or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {% if tool_call.function.arguments is string %}{{ tool_call.function.arguments }}{% else %}{{ tool_call.function.arguments | tojson }}{% endif %}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking %}<think>
{% endif %}{% endif %}"""

DEEPSEEK_TEMPLATE = """{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}{% endif %}{% endfor %}
{%- if tools %}

## Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}<｜Assistant｜>{{ message['content'] or '' }}<｜tool▁calls▁begin｜>
{%- for tool in message['tool_calls'] %}{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>
{%- elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>
{%- elif message['role'] == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}{%- if messages[0]['role'] == 'system' %}<|start_header_id|>system<|end_header_id|>

{{ messages[0]['content'] }}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}<|start_header_id|>user<|end_header_id|>

{% if tools and loop.last %}Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{% endif %}{{ message['content'] }}<|eot_id|>
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}<|start_header_id|>assistant<|end_header_id|>

{%- for tool_call in message['tool_calls'] %}{{ '{"name": "' + tool_call.function.name + '", "parameters": ' }}{{ tool_call.function.arguments | tojson }}{{ "}" }}{% endfor %}<|eot_id|>
{%- elif message['role'] == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>

{{ message['content'] }}<|eot_id|>
{%- elif message['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message['content'] }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}
{#- <|python_tag|> starts a built-in tool call in Llama 3.1 #}"""
