//! An HTTP server on 127.0.0.1 that keeps every webhook POST it is sent, in
//! order, with the body's raw bytes (the signature covers those bytes, not a
//! re-serialised body), and answers each with the status the test chooses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use miniserde::json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// One webhook request as it arrived.
#[derive(Clone, Debug)]
pub struct Delivery {
    /// The body, unparsed.
    pub body: String,
    /// Its `Stripe-Signature` header.
    pub signature: String,
    pub content_type: String,
}

impl Delivery {
    /// `data.object.id` of the event delivered.
    pub fn object_id(&self) -> Option<String> {
        let event: Value = miniserde::json::from_str(&self.body).ok()?;
        let Value::Object(event) = event else {
            return None;
        };
        let Some(Value::Object(data)) = event.get("data") else {
            return None;
        };
        let Some(Value::Object(object)) = data.get("object") else {
            return None;
        };
        match object.get("id") {
            Some(Value::String(id)) => Some(id.clone()),
            _ => None,
        }
    }

    /// The `t=` of its `Stripe-Signature`.
    pub fn timestamp(&self) -> i64 {
        self.signature
            .split(',')
            .find_map(|p| p.strip_prefix("t="))
            .and_then(|t| t.parse().ok())
            .expect("a t= in Stripe-Signature")
    }
}

type Answer = Box<dyn Fn(&Delivery) -> u16 + Send>;

struct Shared {
    deliveries: Mutex<Vec<Delivery>>,
    arrived: Notify,
    answer: Mutex<Answer>,
}

pub struct Receiver {
    /// `http://127.0.0.1:PORT/webhooks`
    pub url: String,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Receiver {
    pub async fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/webhooks", listener.local_addr().unwrap());
        let shared = Arc::new(Shared {
            deliveries: Mutex::new(Vec::new()),
            arrived: Notify::new(),
            answer: Mutex::new(Box::new(|_| 200)),
        });
        let serving = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let shared = Arc::clone(&serving);
                tokio::spawn(async move {
                    let _ = serve(stream, &shared).await;
                });
            }
        });
        Receiver { url, shared, task }
    }

    /// Answers every later delivery with the status ANSWER gives it.
    pub fn answer_with(&self, answer: impl Fn(&Delivery) -> u16 + Send + 'static) {
        *self.shared.answer.lock().unwrap() = Box::new(answer);
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.shared.deliveries.lock().unwrap().clone()
    }

    /// The first N deliveries of events about OBJECT_ID, waiting up to 15 s.
    pub async fn of_object(&self, object_id: &str, n: usize) -> Vec<Delivery> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let arrived = self.shared.arrived.notified();
            let mine: Vec<Delivery> = self
                .deliveries()
                .into_iter()
                .filter(|d| d.object_id().as_deref() == Some(object_id))
                .collect();
            if mine.len() >= n {
                return mine.into_iter().take(n).collect();
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                panic!(
                    "{} of {n} deliveries about {object_id} within 15 s",
                    mine.len()
                );
            }
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one request (headers, then a body of its Content-Length), keeps
/// it, and answers it; one request per connection.
async fn serve(mut stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let headers: HashMap<String, String> = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let length: usize = headers
        .get("content-length")
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let delivery = Delivery {
        body: String::from_utf8_lossy(&buf[head_end..]).to_string(),
        signature: headers.get("stripe-signature").cloned().unwrap_or_default(),
        content_type: headers.get("content-type").cloned().unwrap_or_default(),
    };
    let status = (shared.answer.lock().unwrap())(&delivery);
    shared.deliveries.lock().unwrap().push(delivery);
    shared.arrived.notify_waiters();
    stream
        .write_all(
            format!("HTTP/1.1 {status} Answer\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    stream.shutdown().await
}
