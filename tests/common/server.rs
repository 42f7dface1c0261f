//! What the tests of `folio serve` share: the server as a person starts it (the real binary,
//! a port of its own, a test library), and a real HTTP client (ureq) that reads what any
//! OpenAI client reads: the status, the JSON body, the server-sent events.
#![allow(dead_code)] // each test file uses its own share of these

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// How long a request may take before the test calls it a hang.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// A running `folio serve`, stopped when dropped.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT/v1`
    pub base: String,
    pub agent: ureq::Agent,
    /// The server's request log (stderr), read on a thread.
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    /// `folio serve --port 0` on the CPU with `args`, the environment `env`, and the library at
    /// `home`; waits for its "serves … at URL" line.
    pub fn start(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_folio"));
        cmd.args(["serve", "--device", "cpu", "--port", "0"]).args(args).env("FOLIO_HOME", home);
        cmd.env_remove("FOLIO_API_KEY").env_remove("FOLIO_MODEL");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start folio serve");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let Some(at) = line.find("http://") else {
            let _ = child.wait();
            panic!("folio serve did not start: {line}\n{}", log.lock().unwrap());
        };
        let base = line[at..].split_whitespace().next().unwrap().to_owned();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(REQUEST_TIMEOUT))
            .build()
            .into();
        Server { child, base, agent, log }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// POSTs `body` to `path` (under /v1): the status and the JSON body.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut r = self.agent.post(format!("{}{path}", self.base)).send_json(body).expect("request");
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
    }

    /// POSTs raw bytes (for bad JSON).
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let mut r = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Content-Type", "application/json")
            .send(body)
            .expect("request");
        let status = r.status().as_u16();
        (status, r.body_mut().read_json().unwrap())
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        let mut r = self.agent.get(format!("{}{path}", self.base)).call().expect("request");
        let status = r.status().as_u16();
        (status, r.body_mut().read_json().unwrap())
    }

    /// POSTs a streaming request: the status and every `data:` payload, in order.
    pub fn stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let r = self.agent.post(format!("{}{path}", self.base)).send_json(body).expect("request");
        let status = r.status().as_u16();
        let reader = BufReader::new(r.into_body().into_reader());
        let events =
            reader.lines().map_while(Result::ok).filter_map(|l| l.strip_prefix("data: ").map(str::to_owned)).collect();
        (status, events)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The text of a chat completion's first choice.
pub fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no content: {v}"))
}

/// A chat request body.
pub fn chat(model: &str, question: &str) -> Value {
    serde_json::json!({ "model": model, "messages": [{ "role": "user", "content": question }], "temperature": 0 })
}
