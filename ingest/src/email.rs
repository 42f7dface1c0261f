//! E-mail: a message (.eml) or a mailbox (.mbox) read with `mail-parser` (Stalwart's RFC 5322
//! and MIME parser: encodings, charsets, multipart). Each message is its headers (From, To,
//! Date, Subject), its text parts (HTML-only bodies turned into text), and the names of its
//! attachments; in a mailbox each message is a part named by its subject.

use std::io::Cursor;

use mail_parser::{MessageParser, MimeHeaders};

use crate::limits::{Budget, LimitHit};
use crate::out::Out;
use crate::{Extracted, Format, Refusal};

pub(crate) fn message(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let mut out = Out::new(budget);
    if !message_into(&mut out, bytes, false)? {
        return Err(Refusal::damaged(Format::Email, "no message headers could be read"));
    }
    Ok(out.finish())
}

pub(crate) fn mbox(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let mut out = Out::new(budget);
    let mut read = 0;
    for message in mail_parser::mailbox::mbox::MessageIterator::new(Cursor::new(bytes)) {
        budget.tick()?;
        let message = message.map_err(|e| Refusal::damaged(Format::Mbox, e))?;
        read += usize::from(message_into(&mut out, message.contents(), true)?);
    }
    if read == 0 {
        return Err(Refusal::damaged(Format::Mbox, "no message in it could be read"));
    }
    Ok(out.finish())
}

/// One message written to `out`; false when `bytes` hold no message.
fn message_into(out: &mut Out, bytes: &[u8], part: bool) -> Result<bool, LimitHit> {
    let Some(message) = MessageParser::default().parse(bytes) else { return Ok(false) };
    let subject = message.subject().unwrap_or("(no subject)");
    if part {
        out.part(subject);
    }
    let addresses = |a: Option<&mail_parser::Address>| {
        a.and_then(|a| a.as_list())
            .map(|list| {
                list.iter()
                    .map(|x| match (x.name(), x.address()) {
                        (Some(n), Some(a)) => format!("{n} <{a}>"),
                        (Some(n), None) => n.to_owned(),
                        (None, Some(a)) => a.to_owned(),
                        (None, None) => String::new(),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    let mut headers = vec![format!("Subject: {subject}")];
    for (name, value) in [("From", addresses(message.from())), ("To", addresses(message.to()))] {
        if !value.is_empty() {
            headers.push(format!("{name}: {value}"));
        }
    }
    if let Some(date) = message.date() {
        headers.push(format!("Date: {}", date.to_rfc822()));
    }
    out.verbatim(&headers.join("\n"))?;
    for i in 0..message.text_body_count() {
        if let Some(text) = message.body_text(i) {
            out.verbatim(text.trim())?;
        }
    }
    let attachments: Vec<String> = message
        .attachments()
        .map(|a| {
            let kind = a.content_type().map(|t| match t.subtype() {
                Some(sub) => format!("{}/{sub}", t.ctype()),
                None => t.ctype().to_owned(),
            });
            match (a.attachment_name(), kind) {
                (Some(name), Some(kind)) => format!("{name} ({kind})"),
                (Some(name), None) => name.to_owned(),
                (None, Some(kind)) => format!("unnamed ({kind})"),
                (None, None) => "unnamed".to_owned(),
            }
        })
        .collect();
    if !attachments.is_empty() {
        out.verbatim(&format!("Attachments (not read): {}", attachments.join(", ")))?;
    }
    Ok(true)
}
