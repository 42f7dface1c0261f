import { describe, expect, it } from 'vitest';
import { answerCost, contextName, when } from './library';

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

describe('answerCost', () => {
  it('names the length, the right answers over each prefill and the KL', () => {
    const a = {
      prefill: 'sparse:block=64,keys=2048,sinks=64,window=1024',
      length: 1048576,
      prompts: 3,
      answered: 2,
      dense_answered: 1,
      lost: 0,
      mean_kl: 0.13621,
      top1_agreement: 0.86,
      measured: 'H200, 2026-12-02',
    };
    expect(answerCost(a)).toBe('at 1M, 2 of 3 answers right (over a dense prefill 1), KL 0.1362');
    expect(answerCost({ ...a, length: 131072 })).toContain('at 128k,');
    expect(answerCost({ ...a, length: 5000 })).toContain('at 5,000,');
  });
});
