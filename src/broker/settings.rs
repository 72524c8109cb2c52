//! An existing stream's or durable consumer's settings against the
//! configuration. JetStream keeps what an object was made with, whatever a
//! process that starts later was told; so at every start the relay (for the
//! stream) and the consumer (for its durable consumer) compare. Where a
//! setting differs and JetStream can change it, the configuration wins: it
//! is updated, and the log names each change. Where JetStream cannot,
//! nothing starts, and the error ([`Refused`]) names each such setting.

use std::fmt;

/// One setting that differs: what the object has, what the configuration
/// wants, and whether JetStream cannot change it on an existing object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub setting: &'static str,
    pub has: String,
    pub wants: String,
    pub fixed: bool,
}

/// The settings of one object that differ from the configuration.
#[derive(Debug, Default)]
pub struct Changes(Vec<Change>);

impl Changes {
    /// Notes `setting` when what the object has is not what is wanted.
    pub fn compare(&mut self, setting: &'static str, has: String, wants: String, fixed: bool) {
        if has != wants {
            self.0.push(Change {
                setting,
                has,
                wants,
                fixed,
            });
        }
    }

    /// Whether the object is as the configuration wants it.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `Err` naming each setting JetStream cannot change, if any; `what`
    /// names the object, `way_out` says what an operator can do.
    pub fn refuse_fixed(&self, what: String, way_out: &'static str) -> Result<(), Refused> {
        let fixed: Vec<Change> = self.0.iter().filter(|c| c.fixed).cloned().collect();
        if fixed.is_empty() {
            return Ok(());
        }
        Err(Refused {
            what,
            fixed,
            way_out,
        })
    }
}

impl fmt::Display for Changes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let each: Vec<String> = (self.0.iter())
            .map(|c| format!("{} {} -> {}", c.setting, c.has, c.wants))
            .collect();
        f.write_str(&each.join(", "))
    }
}

/// An object holds settings JetStream cannot change, and the configuration
/// asks for others: the process that needs it does not start.
#[derive(Debug, thiserror::Error)]
pub struct Refused {
    pub what: String,
    pub fixed: Vec<Change>,
    pub way_out: &'static str,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} has settings JetStream cannot change:", self.what)?;
        for c in &self.fixed {
            write!(
                f,
                " {} is {}, the configuration asks {};",
                c.setting, c.has, c.wants
            )?;
        }
        write!(f, " {}", self.way_out)
    }
}
