//! The documentation held against the code: the error table of
//! docs/api.md names exactly the codes the service has, each at its status.

use std::collections::BTreeSet;

use oncepay_core::problem::ProblemCode;

/// Codes documented at another status than [`ProblemCode::status`] gives
/// them, because it depends on where they arise: `resource_missing` is `404`
/// for a path and `400` for a parameter; `http_error` keeps the status of
/// the layer that raised it.
const OTHER_STATUSES: &[(ProblemCode, &str)] = &[
    (ProblemCode::ResourceMissing, "404"),
    (ProblemCode::HttpError, "4xx/5xx"),
];

/// The rows of the error table in docs/api.md: the status cell, and the
/// codes of the `code` cell, which are its backquoted names outside
/// parentheses (inside them, `(param `source`)` names a parameter).
fn documented_rows() -> Vec<(String, Vec<String>)> {
    let doc = std::fs::read_to_string("docs/api.md").expect("read docs/api.md");
    let section = doc
        .split("\n## Errors\n")
        .nth(1)
        .expect("an Errors section in docs/api.md");
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .filter_map(|line| {
            let mut cells = line.strip_prefix("| ")?.split(" | ");
            let status = cells.next()?.trim();
            // The header and the separator row.
            if !status.starts_with(|c: char| c.is_ascii_digit()) {
                return None;
            }
            Some((
                status.to_owned(),
                backquoted_outside_parentheses(cells.next()?),
            ))
        })
        .collect()
}

fn backquoted_outside_parentheses(cell: &str) -> Vec<String> {
    let (mut names, mut depth, mut name) = (Vec::new(), 0_u32, None::<String>);
    for c in cell.chars() {
        match (c, name.as_mut()) {
            ('`', Some(_)) => names.extend(name.take()),
            ('`', None) if depth == 0 => name = Some(String::new()),
            (c, Some(name)) => name.push(c),
            ('(', None) => depth += 1,
            (')', None) => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    names
}

#[test]
fn the_api_reference_documents_every_error_code_and_only_codes_that_exist() {
    let rows = documented_rows();
    assert!(rows.len() > 20, "the error table was not found: {rows:?}");
    let documented: BTreeSet<&str> = rows
        .iter()
        .flat_map(|(_, codes)| codes.iter().map(String::as_str))
        .collect();
    let existing: BTreeSet<&str> = ProblemCode::ALL.iter().map(|c| c.as_str()).collect();
    let undocumented: Vec<_> = existing.difference(&documented).collect();
    let invented: Vec<_> = documented.difference(&existing).collect();
    assert!(
        undocumented.is_empty() && invented.is_empty(),
        "codes missing from docs/api.md: {undocumented:?}; \
         codes in docs/api.md that the service does not have: {invented:?}"
    );
    for (status, codes) in &rows {
        for name in codes {
            let code = ProblemCode::ALL
                .into_iter()
                .find(|c| c.as_str() == name)
                .unwrap();
            assert!(
                code.status().as_str() == status
                    || OTHER_STATUSES.contains(&(code, status.as_str())),
                "docs/api.md lists {name} under {status}; the service answers it {}",
                code.status()
            );
        }
    }
}
