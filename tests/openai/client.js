// The k3-serve client test (tests/t_serve.c): the official openai client
// against a k3-serve on 127.0.0.1:PORT, completions and chat completions,
// streamed and not; prints one JSON object of the texts it got.
//   node client.js PORT API_KEY
const OpenAI = require("openai");

async function main() {
    const [port, key] = process.argv.slice(2);
    const baseURL = `http://127.0.0.1:${port}/v1`;
    const client = new OpenAI({ baseURL, apiKey: key, maxRetries: 0, timeout: 60000 });
    const out = {};
    const comp = { model: "m", prompt: "Once upon", max_tokens: 10, temperature: 0.7, seed: 3 };
    const r = await client.completions.create(comp);
    out.completion = r.choices[0].text;
    let s = "";
    for await (const ch of await client.completions.create({ ...comp, stream: true }))
        s += ch.choices[0]?.text ?? "";
    out.completion_stream = s;
    const chat = {
        model: "m",
        messages: [{ role: "user", content: "Tell me" }],
        max_tokens: 16,
        temperature: 0.7,
        seed: 3,
    };
    const c = await client.chat.completions.create(chat);
    out.chat = c.choices[0].message.content;
    out.chat_reasoning = c.choices[0].message.reasoning_content ?? "";
    let cs = "", rs = "";
    const st = await client.chat.completions.create({ ...chat, stream: true, stream_options: { include_usage: true } });
    for await (const ch of st) {
        const d = ch.choices[0]?.delta ?? {};
        cs += d.content ?? "";
        rs += d.reasoning_content ?? "";
    }
    out.chat_stream = cs;
    out.chat_stream_reasoning = rs;
    // a wrong key: the client's AuthenticationError with status 401
    const bad = new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 });
    try {
        await bad.completions.create(comp);
        out.unauthorized_status = 200;
    } catch (e) {
        out.unauthorized_status = e.status;
    }
    console.log(JSON.stringify(out));
}

main().catch((e) => {
    console.error(String(e));
    process.exit(1);
});
