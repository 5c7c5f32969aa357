//! Keeps the lock's credential out of what other processes can read of the guard's own.
//!
//! The app, and anything else running as the guard's user, could otherwise read the URL and its
//! password from `/proc/<guard>/environ` (`SENTINEL_GUARD_URL`) and `/proc/<guard>/cmdline`
//! (`--url`). Both files are read straight from the guard's memory, so the values are overwritten
//! where the kernel put them, once the configuration has been read from them. The process is also
//! made non-dumpable, which gives `/proc/<guard>/environ` and `mem` to root alone and refuses a
//! same-user `ptrace`.
//!
//! What remains: the command line is readable by every process on the host during the moments
//! between the guard's exec and this overwrite, which is why `--url-file` stays the
//! recommendation; and root can read anything.

use std::fs;

/// The environment variable that may carry the URL.
const URL_VAR: &[u8] = b"SENTINEL_GUARD_URL=";
/// What an overwritten value starts with; the rest of it becomes NUL bytes, so neither the value nor
/// its length shows.
const MARK: &[u8] = b"***";

/// Overwrites the URL wherever `/proc/self/{environ,cmdline}` would show it, and makes the process
/// non-dumpable. Must run once the configuration has been read, and before any other thread starts
/// (nothing else may be reading these bytes meanwhile). Best effort: a kernel that does not say
/// where they are leaves them as they were.
pub fn conceal_credentials() {
    let _ = nix::sys::prctl::set_dumpable(false);
    let Some(areas) = fs::read_to_string("/proc/self/stat")
        .ok()
        .as_deref()
        .and_then(parse_areas)
    else {
        return;
    };
    // SAFETY: the kernel reports these ranges as the process's argument and environment strings,
    // on its initial stack, mapped and writable for the process's whole life. No reference to
    // them is alive: std and libc keep only raw pointers, read again on use, and no other thread
    // exists yet.
    unsafe {
        if let Some(args) = area(areas.args) {
            conceal_url_args(args);
        }
        if let Some(env) = area(areas.env) {
            conceal_url_var(env);
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Areas {
    args: (usize, usize),
    env: (usize, usize),
}

/// `arg_start`, `arg_end`, `env_start`, `env_end`: fields 48 to 51 of `/proc/self/stat` (proc(5)),
/// counted after the command name, which may itself hold spaces and parentheses.
fn parse_areas(stat: &str) -> Option<Areas> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name, so field N is at index N - 3.
    let fields: Vec<usize> = after_comm
        .split_whitespace()
        .skip(48 - 3)
        .take(4)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [arg_start, arg_end, env_start, env_end] = fields[..] else {
        return None;
    };
    (arg_start < arg_end && env_start <= env_end).then_some(Areas {
        args: (arg_start, arg_end),
        env: (env_start, env_end),
    })
}

/// # Safety
/// `range` must be memory of this process that is mapped, writable and not otherwise borrowed.
unsafe fn area<'a>((start, end): (usize, usize)) -> Option<&'a mut [u8]> {
    (start != 0 && end > start)
        .then(|| unsafe { std::slice::from_raw_parts_mut(start as *mut u8, end - start) })
}

/// Blanks the value of every `--url VALUE`, `--url=VALUE`, `-u VALUE` and `-uVALUE` among the
/// guard's own options: those before the `--` that starts the app's command.
fn conceal_url_args(args: &mut [u8]) {
    let mut value_next = false;
    for arg in args.split_mut(|b| *b == 0) {
        if value_next {
            value_next = false;
            blank(arg);
            continue;
        }
        match &arg[..] {
            b"--" => return,
            b"--url" => value_next = true,
            a if a.starts_with(b"--url=") => blank(&mut arg[6..]),
            a if a.starts_with(b"--") => {}
            a if a.starts_with(b"-") => value_next = conceal_short_cluster(&mut arg[1..]),
            _ => {}
        }
    }
}

/// A cluster of short options (`-u URL`, `-uURL`, `-wu URL`, `-wuURL`): the first option that takes
/// a value takes the rest of the cluster, or the next argument if nothing is left. Blanks the
/// URL's value within the cluster; true when it is the next argument. (`-w` takes its value only
/// after `=`, which ends the cluster too; `-n` takes a name.)
fn conceal_short_cluster(cluster: &mut [u8]) -> bool {
    for at in 0..cluster.len() {
        match cluster[at] {
            b'u' if at + 1 == cluster.len() => return true,
            b'u' => {
                blank(&mut cluster[at + 1..]);
                return false;
            }
            b'n' | b'=' => return false,
            _ => {}
        }
    }
    false
}

/// Blanks the value of `SENTINEL_GUARD_URL` in the environment's strings.
fn conceal_url_var(env: &mut [u8]) {
    for entry in env.split_mut(|b| *b == 0) {
        if entry.starts_with(URL_VAR) {
            blank(&mut entry[URL_VAR.len()..]);
        }
    }
}

fn blank(value: &mut [u8]) {
    let mark = MARK.len().min(value.len());
    value[..mark].copy_from_slice(&MARK[..mark]);
    value[mark..].fill(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_the_url_option_is_blanked_and_nothing_after_the_separator() {
        let mut args = b"sentinel-guard\0--url\0mysql://u:pw@h/db\0-n\0x\0--url=redis://:pw@h\0-uX:pw\0-u\0postgres://u:pw@h\0-wu\0file:pw\0-wuY:pw\0-nunamed\0--\0app\0--url\0keep:pw\0".to_vec();
        conceal_url_args(&mut args);
        let text = String::from_utf8_lossy(&args);
        assert_eq!(text.matches("pw").count(), 1, "{text:?}");
        assert!(text.ends_with("--url\0keep:pw\0"), "{text:?}");
        assert!(text.contains("--url\0***\0\0"), "{text:?}");
        assert!(text.contains("--url=***\0"), "{text:?}");
        assert!(text.contains("-n\0x\0"), "{text:?}");
        assert!(text.contains("-wu\0***\0"), "{text:?}");
        assert!(text.contains("-wu***\0"), "{text:?}");
        assert!(text.contains("-nunamed\0"), "a name is no URL: {text:?}");
    }

    #[test]
    fn only_the_url_variable_is_blanked() {
        let mut env =
            b"HOME=/root\0SENTINEL_GUARD_URL=mysql://u:pw@h/db\0SENTINEL_GUARD_URL_FILE=/run/u\0"
                .to_vec();
        conceal_url_var(&mut env);
        let text = String::from_utf8_lossy(&env);
        assert!(!text.contains("pw"), "{text:?}");
        assert!(
            text.contains("HOME=/root\0SENTINEL_GUARD_URL=***\0"),
            "{text:?}"
        );
        assert!(
            text.ends_with("SENTINEL_GUARD_URL_FILE=/run/u\0"),
            "{text:?}"
        );
    }

    #[test]
    fn the_areas_are_read_after_a_name_with_spaces() {
        let mut fields: Vec<String> = (3..=52).map(|n| n.to_string()).collect();
        fields[48 - 3] = "1000".into();
        fields[49 - 3] = "2000".into();
        fields[50 - 3] = "2000".into();
        fields[51 - 3] = "3000".into();
        let stat = format!("42 (a b) c) {}", fields.join(" "));
        assert_eq!(
            parse_areas(&stat),
            Some(Areas {
                args: (1000, 2000),
                env: (2000, 3000)
            })
        );
        assert_eq!(parse_areas("42 (x) S 1 2"), None);
        let real = fs::read_to_string("/proc/self/stat").unwrap();
        assert!(parse_areas(&real).is_some());
    }
}
