//! A `llama-graph serve` process for the tests: on 127.0.0.1 with an
//! OS-assigned port, ready once `/health` answers 200, killed when dropped.
//! Plus a minimal HTTP/1.1 client over a raw socket, for requests a normal
//! client would not send.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    /// Everything the server wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `llama-graph serve --port 0 ARGS` and waits (bounded) until
    /// it serves.
    pub fn start(args: &[&str]) -> Server {
        let mut s = Server::spawn(args);
        s.wait_ready();
        s
    }

    /// Starts the server and returns as soon as it listens (the model may
    /// still be loading).
    pub fn spawn(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn llama-graph serve");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("listening on http://") {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(a) => a.parse().expect("a socket address"),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the server never said where it listens:\n{}",
                    log.lock().unwrap()
                );
            }
        };
        Server { child, addr, log }
    }

    /// Waits (bounded) until `/health` answers 200.
    pub fn wait_ready(&mut self) {
        for _ in 0..3000 {
            if let Ok((200, _)) = self.try_request("GET", "/health", &[], b"") {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("the server exited ({st}):\n{}", self.log.lock().unwrap());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "the server never became ready:\n{}",
            self.log.lock().unwrap()
        );
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's resident set size in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// One request on a fresh connection (`Connection: close`).
    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<(u16, String)> {
        let mut s = TcpStream::connect(self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(120)))?;
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())?;
        s.write_all(body)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        Ok(parse_response(&raw))
    }

    /// Like [`Server::try_request`], panicking on I/O errors.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, String) {
        self.try_request(method, path, headers, body.as_bytes())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// A gauge or counter from `/metrics` (headers are sent to pass an API key).
    pub fn metric(&self, name: &str, headers: &[(&str, &str)]) -> f64 {
        let (code, text) = self.request("GET", "/metrics", headers, "");
        assert_eq!(code, 200, "{text}");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status code and body (chunked bodies are returned undecoded, which is
/// enough to search them).
pub fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}
