//! Checking one variant: every state reachable within the bounds, or, for
//! a naive design, until the property it breaks is broken.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use stateright::{Checker, Expectation, HasDiscoveries, Model, Path};

use crate::model::{Action, Protocol, State};

/// What checking a variant found.
pub struct Report {
    pub model: Protocol,
    /// Distinct states explored.
    pub states: usize,
    pub took: Duration,
    /// Each property broken, with the path that breaks it: the shortest,
    /// as the search is breadth first on one thread.
    pub broken: Vec<(&'static str, Path<State, Action>)>,
    /// The "sometimes" properties seen to hold: the model is not safe
    /// by doing nothing.
    pub seen: Vec<&'static str>,
}

impl Report {
    /// The counterexample of `property`, if it was broken.
    pub fn counterexample(&self, property: &str) -> Option<&Path<State, Action>> {
        let found = self.broken.iter().find(|(name, _)| *name == property);
        found.map(|(_, path)| path)
    }
}

/// Checks `model`: every reachable state, or until the first counterexample
/// (of the property a naive design is expected to break; of any, for the
/// protocol), which breadth first is a shortest.
pub fn check(model: Protocol) -> Report {
    let started = Instant::now();
    let done = match model.variant.breaks() {
        Some(property) => HasDiscoveries::AnyOf(BTreeSet::from([property])),
        // A protocol that breaks something stops there too.
        None => HasDiscoveries::AnyFailures,
    };
    let checker = model.clone().checker().finish_when(done).spawn_bfs().join();
    let discoveries = checker.discoveries();
    let (mut broken, mut seen) = (Vec::new(), Vec::new());
    for property in model.properties() {
        let Some(path) = discoveries.get(property.name) else {
            continue;
        };
        match property.expectation {
            Expectation::Sometimes => seen.push(property.name),
            _ => broken.push((property.name, path.clone())),
        }
    }
    Report {
        states: checker.unique_state_count(),
        took: started.elapsed(),
        model,
        broken,
        seen,
    }
}
