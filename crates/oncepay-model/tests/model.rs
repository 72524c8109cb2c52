//! The model checked in both directions: the protocol has no counterexample
//! within its bounds, and each naive design has one, as short as
//! docs/model.md says. Each test prints the states it explored.

use oncepay_model::check::{Report, check};
use oncepay_model::explain::timeline;
use oncepay_model::properties::{CRASHES, REPLAYS, SUCCEEDS};
use oncepay_model::{Protocol, Variant};

fn checked(variant: Variant) -> Report {
    let report = check(Protocol::new(variant));
    let took = report.took.as_secs_f64();
    eprintln!(
        "{variant}: {} states explored in {took:.1} s",
        report.states
    );
    report
}

#[test]
fn the_protocol_breaks_no_property_in_any_reachable_state_and_is_not_safe_by_doing_nothing() {
    let report = checked(Variant::Real);
    let broken: Vec<_> = report.broken.iter().map(|(name, _)| *name).collect();
    assert!(broken.is_empty(), "the protocol breaks {broken:?}");
    for property in [SUCCEEDS, CRASHES, REPLAYS] {
        assert!(report.seen.contains(&property), "never: {property}");
    }
    assert!(report.states > 100_000, "too small a model to mean much");
}

/// Each naive design, the property it breaks, and the length of its
/// shortest counterexample (docs/model.md's table).
const NAIVE: [(Variant, usize); 8] = [
    (Variant::CheckThenAct, 13),
    (Variant::KeyAfterWork, 11),
    (Variant::TwoTransactions, 13),
    (Variant::ShortTtl, 13),
    (Variant::NewKeyPerAttempt, 11),
    (Variant::NoFingerprint, 10),
    (Variant::NoVoidFence, 8),
    (Variant::RedisSetNx, 13),
];

#[test]
fn each_naive_design_breaks_its_property_by_its_shortest_counterexample() {
    for (variant, steps) in NAIVE {
        let report = checked(variant);
        let property = variant.breaks().expect("a naive design breaks something");
        let path = report.counterexample(property);
        let path = path.unwrap_or_else(|| panic!("{variant}: no counterexample of {property}"));
        eprint!("{}", timeline(&report.model, path, property));
        let found = path.clone().into_actions().len();
        assert_eq!(
            found, steps,
            "{variant}: the shortest counterexample's steps"
        );
    }
}
