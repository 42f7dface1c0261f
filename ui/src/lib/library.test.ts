import { describe, expect, it } from 'vitest';
import { contextName, when } from './library';

describe('when', () => {
  const now = new Date(2026, 10, 29, 15, 0);
  it('says the time for today, the day for another day, the year for another year', () => {
    expect(when(new Date(2026, 10, 29, 9, 5).toISOString(), now)).toBe('09:05');
    expect(when(new Date(2026, 4, 3, 9, 5).toISOString(), now)).toBe('3 May');
    expect(when(new Date(2025, 4, 3, 9, 5).toISOString(), now)).toBe('3 May 2025');
  });
  it('says nothing for what is not a time', () => {
    expect(when('not a time', now)).toBe('');
  });
});

describe('contextName', () => {
  it('names a folder by itself, a file without its extension, several files by the first and the count', () => {
    expect(contextName(['/home/me/Papers/'])).toBe('Papers');
    expect(contextName(['/home/me/Papers', '/tmp/junk'])).toBe('Papers');
    expect(contextName(['/docs/notes.md'])).toBe('notes');
    expect(contextName(['/docs/notes.md', '/docs/a.pdf', '/docs/b.txt'])).toBe('notes and 2 more');
    expect(contextName(['/docs/.hidden'])).toBe('hidden');
    expect(contextName([])).toBe('Documents');
  });
});
