//! How a command prints its result on stdout: JSON for scripts (`--json`), text for people.

use serde::Serialize;

/// `report` as pretty-printed JSON when `json`, else as `print_text` writes it.
pub fn print_report<T: Serialize>(
    json: bool,
    report: &T,
    print_text: impl FnOnce(&T),
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print_text(report);
    }
    Ok(())
}
