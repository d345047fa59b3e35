"""The OpenAI chat-completions and completions wire formats, in the order a request meets them.

`schemas` (what a request may say) -> `refusals` (what this server will not do) -> `parsing`
(bytes to a request, or an `InvalidInput` naming the field) -> `conversion` (a request's
`SamplingParams`) -> `bodies` (the JSON that goes back).
"""
