//! Usage: the token counts an upstream reported for one answer ([`Usage`],
//! what calibration and the metrics read, from each API's own fields by
//! `TapRead::usage`), and the counts of the rounds condense answered itself,
//! summed field by field ([`Sum`]) to be added to what the client sees.

use serde::Deserialize;
use serde_json::{Map, Value, json};

/// Token usage as the upstream reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub total_tokens: u64,
}

impl Usage {
    /// A usage of `prompt` and `completion` tokens.
    pub fn of(prompt: u64, completion: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

/// Token counts summed field by field over several answers' `usage`
/// objects, in the API's own field names.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sum(Map<String, Value>);

impl Sum {
    /// Adds the integer fields of `usage` (and of its `*_details` objects).
    pub fn add(&mut self, usage: Option<&Value>) {
        if let Some(Value::Object(u)) = usage {
            sum_into(&mut self.0, u);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds these counts to the `usage` of a response object (where a
    /// Responses stream's event holds it, under `response`).
    pub fn add_to(&self, value: &mut Value) {
        if self.0.is_empty() {
            return;
        }
        if let Some(Value::Object(u)) = value.get_mut("usage") {
            add_existing(u, &self.0);
        }
    }

    /// Adds these counts to a `usage` value in place; whether there were
    /// any to add.
    pub fn add_to_usage(&self, usage: Option<&mut Value>) -> bool {
        match usage {
            Some(u) if u.is_object() && !self.is_empty() => {
                let mut holder = json!({"usage": u.take()});
                self.add_to(&mut holder);
                *u = holder["usage"].take();
                true
            }
            _ => false,
        }
    }
}

/// Adds `from`'s numbers to the fields `into` has (a stream's usage event
/// names only what it reports).
fn add_existing(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, slot) in into.iter_mut() {
        match (slot, from.get(k)) {
            (Value::Object(a), Some(Value::Object(b))) => add_existing(a, b),
            (slot @ Value::Number(_), Some(Value::Number(b))) => {
                if let (Some(a), Some(b)) = (slot.as_u64(), b.as_u64()) {
                    *slot = json!(a + b);
                }
            }
            _ => {}
        }
    }
}

fn sum_into(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(Value::Object(a)), Value::Object(b)) => sum_into(a, b),
            (Some(slot), Value::Number(b)) => {
                if let (Some(a), Some(b)) = (slot.as_u64(), b.as_u64()) {
                    *slot = json!(a + b);
                }
            }
            (None, Value::Number(_) | Value::Object(_)) => {
                into.insert(k.clone(), v.clone());
            }
            _ => {}
        }
    }
}
