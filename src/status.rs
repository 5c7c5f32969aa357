//! `sentinel-guard status`: who holds a lock, without taking or disturbing it. Exit codes follow LSB
//! `status`, so scripts and probes can branch on them.

use serde_json::{json, Map, Value};

use crate::backend::{self, HolderInfo};
use crate::cli::OutputFormat;
use crate::config::StatusConfig;
use crate::outcome::EXIT_UNAVAILABLE;

pub const EXIT_HELD: u8 = 0;
pub const EXIT_FREE: u8 = 3;

pub async fn run(config: &StatusConfig) -> u8 {
    let answer = backend::status(
        &config.target,
        &config.name,
        config.connect_timeout,
        config.check_timeout,
    )
    .await;
    match answer {
        Ok(holder) => {
            println!("{}", render(config, holder.as_ref()));
            if holder.is_some() {
                EXIT_HELD
            } else {
                EXIT_FREE
            }
        }
        Err(e) => {
            eprintln!("sentinel-guard: error: {e}");
            EXIT_UNAVAILABLE
        }
    }
}

fn render(config: &StatusConfig, holder: Option<&HolderInfo>) -> String {
    let state = if holder.is_some() { "held" } else { "free" };
    let key = backend::lock_key(&config.target, &config.name);
    match config.format {
        OutputFormat::Text => {
            let mut line = format!(
                "name={} backend={} url={} state={state}",
                config.name,
                config.target.backend_name(),
                config.target.location()
            );
            if let Some(key) = key {
                line.push_str(&format!(" key={key}"));
            }
            if let Some(holder) = holder {
                line.push(' ');
                line.push_str(&holder.to_string());
            }
            line
        }
        OutputFormat::Json => {
            let holder = holder.map(|h| {
                Value::Object(
                    h.fields()
                        .iter()
                        .map(|(k, v)| (k.to_string(), Value::String(v.clone())))
                        .collect::<Map<_, _>>(),
                )
            });
            let mut answer = json!({
                "name": config.name.as_str(),
                "backend": config.target.backend_name(),
                "url": config.target.location(),
                "state": state,
                "holder": holder,
            });
            if let Some(key) = key {
                answer["key"] = json!(key);
            }
            answer.to_string()
        }
    }
}
